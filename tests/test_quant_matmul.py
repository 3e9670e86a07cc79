"""Quantized matrix products against their dequantized jnp references with the same math
(relative error <= 1e-3): the W8A16 Pallas kernel in interpret mode (per-channel and grouped
scales, zeros, split K, padded rows), W8A8 through the FP8 dot, FP8 experts in the grouped
kernel, and the choice of path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite import kernels
from pallasite.kernels import quant_reference as qr
from pallasite.kernels.w8a16_matmul import w8a16_matmul


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def fp8_weights(rng, k, n, groups=1):
    w = rng.normal(size=(k, n)).astype(np.float32)
    blocked = np.abs(w).reshape(groups, k // groups, n).max(1)
    scale = (blocked / 448).astype(np.float32)
    q = jnp.asarray(w / np.repeat(scale, k // groups, 0)).astype(jnp.float8_e4m3fn)
    return q, jnp.asarray(scale)


@pytest.mark.parametrize("m,k,n,groups,split,dtype", [
    (1, 512, 128, 1, 2, jnp.bfloat16),   # decode: one row padded to the block, K split
    (13, 256, 192, 2, 1, jnp.float32),   # group scales (block-wise checkpoints)
    (20, 512, 128, 4, 2, jnp.bfloat16),  # two row blocks, groups within splits
])
def test_w8a16_kernel_equals_reference(m, k, n, groups, split, dtype):
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    q, scale = fp8_weights(rng, k, n, groups)
    got = w8a16_matmul(x, q, scale, block_m=16, block_n=64, block_k=128, split_k=split,
                       interpret=True)
    assert got.shape == (m, n) and got.dtype == dtype
    want = qr.w8a16_reference(x, q, scale)  # the same math, rounded to x's dtype at the end
    assert rel_err(got, want) <= 1e-3
    deq = x.astype(jnp.float32) @ qr.dequantize_matrix(q, scale)  # the plain dequantization
    assert rel_err(qr.w8a16_reference(x.astype(jnp.float32), q, scale), deq) <= 1e-5


def test_w8a16_kernel_with_int8_zero_points():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(4, 256)), jnp.float32)
    q = jnp.asarray(rng.integers(0, 255, (256, 64)) - 128, jnp.int8)
    scale = jnp.asarray(rng.uniform(0.01, 0.02, (2, 64)), jnp.float32)
    zero = jnp.asarray(rng.integers(-3, 3, (2, 64)), jnp.int8)
    got = w8a16_matmul(x, q, scale, zero, block_n=64, block_k=128, interpret=True)
    assert rel_err(got, x @ qr.dequantize_matrix(q, scale, zero)) <= 1e-5


@pytest.mark.parametrize("groups", [1, 2])
def test_w8a8_equals_its_dequantized_reference(groups):
    rng = np.random.default_rng(groups)
    x = jnp.asarray(rng.normal(size=(48, 256)) * rng.uniform(0.1, 10, (48, 1)), jnp.bfloat16)
    q, scale = fp8_weights(rng, 256, 128, groups)
    got = qr.w8a8_matmul(x, q, scale)
    assert got.dtype == jnp.bfloat16
    # the GEMM writes its product in bf16 (one scale a channel): the same math in float32
    assert rel_err(got, qr.w8a8_reference(x, q, scale, product=jnp.bfloat16)) <= 1e-3
    # which is rounded once more than the float32 product, and no more than that
    product = qr.w8a8_reference(x, q, scale, product=jnp.bfloat16)
    assert rel_err(product, qr.w8a8_reference(x, q, scale)) <= (6e-3 if groups == 1 else 0)
    # and what the activations' quantization costs against W8A16
    assert rel_err(got, qr.w8a16_reference(x.astype(jnp.float32), q, scale)) <= 0.05


def test_fp8_experts_in_the_grouped_kernel():
    rng = np.random.default_rng(7)
    e, d, f, m = 4, 128, 128, 40
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    ws = [fp8_weights(rng, *shape) for shape in [(d, f)] * 2 * e + [(f, d)] * e]
    stack = lambda i: (jnp.stack([w[0] for w in ws[i * e:(i + 1) * e]]),
                       jnp.stack([w[1] for w in ws[i * e:(i + 1) * e]]))
    gate, up, down = stack(0), stack(1), stack(2)
    sizes = jnp.asarray([10, 0, 25, 5], jnp.int32)
    got = kernels.grouped_mlp(x, sizes, gate, up, down, interpret=True)
    want = kernels.grouped_mlp(x, sizes, gate, up, down, impl="reference")
    assert rel_err(got, want) <= 1e-5


def test_the_path_is_chosen_by_rows_and_gpu(monkeypatch):
    q = jnp.zeros((64, 64), jnp.float8_e4m3fn)
    rows = lambda m: jnp.zeros((m, 64), jnp.bfloat16)
    assert kernels.quant_mode(rows(1), q) == "w8a16"
    assert kernels.quant_mode(rows(512), q) == "w8a16"  # CPU: no FP8 tensor cores
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(kernels, "has_fp8_tensor_cores", lambda: True)
    assert kernels.quant_mode(rows(2), q) == "w8a16"  # two rows: the W8A16 kernel
    assert kernels.quant_mode(rows(4), q) == "w8a8"
    i8 = q.astype(jnp.int8)
    assert kernels.quant_mode(rows(512), i8) == "w8a8"  # INT8 tensor cores
    assert kernels.quant_mode(rows(512), i8, jnp.zeros((1, 64), jnp.int8)) == "w8a16"
    monkeypatch.setattr(kernels, "has_fp8_tensor_cores", lambda: False)
    assert kernels.quant_mode(rows(512), q) == "w8a16"
    assert kernels.quant_mode(rows(512), i8) == "w8a8"
    with pytest.raises(ValueError, match="W8A8 takes float8_e4m3fn or int8 weights without zeros"):
        kernels.quant_mode(rows(512), q.astype(jnp.int4), mode="w8a8")


def int8_weights(rng, k, n):
    w = rng.normal(size=(n, k)).astype(np.float32)  # stored [N, K], as the model keeps them
    scale = np.abs(w).max(1) / 127
    return jnp.asarray(np.rint(w / scale[:, None]), jnp.int8), jnp.asarray(scale[None])


def test_int8_w8a8_equals_its_dequantized_reference():
    """SmoothQuant's product: per-token INT8 activations, INT8 x INT8 -> INT32, both scales."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(40, 256)) * rng.uniform(0.1, 10, (40, 1)), jnp.bfloat16)
    q, scale = int8_weights(rng, 256, 96)
    got = kernels.quant_matmul(x, q, scale, mode="w8a8", layout="nk")
    assert got.dtype == jnp.bfloat16
    assert rel_err(got, qr.w8a8_int8_reference(x, q, scale, layout="nk")) <= 1e-3
    assert rel_err(got, qr.w8a16_reference(x.astype(jnp.float32), q.T, scale)) <= 0.02
    xq, xs = qr.quantize_rows_int8(x)
    assert xq.dtype == jnp.int8 and int(jnp.max(jnp.abs(xq.astype(jnp.int32)))) == 127
    with pytest.raises(ValueError, match="one scale per output channel"):
        qr.w8a8_int8_matmul(x, q, jnp.ones((2, 96)), layout="nk")


def test_w8a16_kernel_reads_int8_weights_stored_nk():
    """Decode rows of an INT8 W8A8 checkpoint: its weights through the W8A16 kernel."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(2, 512)), jnp.bfloat16)
    q, scale = int8_weights(rng, 512, 128)
    got = w8a16_matmul(x, q, scale, block_n=32, block_k=256, split_k=2, reduce="sum",
                       layout="nk", interpret=True)
    assert rel_err(got, qr.w8a16_reference(x, q.T, scale)) <= 1e-3
