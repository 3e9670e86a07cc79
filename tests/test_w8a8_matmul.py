"""The W8A8 Pallas kernel (interpret mode) and XLA's FP8 dot in both weight layouts against the
dequantized jnp reference (relative error <= 1e-3): per-channel and block-wise [128, 128]
scales, padded rows; and how `quant_matmul` routes W8A8 calls between them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite import kernels
from pallasite.kernels import quant_reference as qr
from pallasite.kernels import w8a8_matmul as wm
from pallasite.kernels import w8a8_mgpu


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def case(seed, m, k, n, block=None):
    """Tokens of very different sizes, and FP8 weights with per-channel scales [1, N] or, with
    `block`, DeepSeek-style [bk, bn] block scales expanded along N to [K / bk, N]."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)) * rng.uniform(0.1, 10, (m, 1)), jnp.bfloat16)
    w = rng.normal(size=(k, n)).astype(np.float32)
    bk, bn = block or (k, 1)
    amax = np.abs(w).reshape(k // bk, bk, n // bn, bn).max((1, 3))
    scale = np.repeat(amax / qr.FP8_MAX, bn, axis=1).astype(np.float32)  # [K / bk, N]
    q = jnp.asarray(w / np.repeat(scale, bk, axis=0)).astype(jnp.float8_e4m3fn)
    return x, q, jnp.asarray(scale)


@pytest.mark.parametrize("m,block,layout", [
    (96, None, "kn"),         # per channel, rows padded to the 64-row block
    (64, (128, 128), "nk"),   # block-wise scales, weight stored [N, K]
])
def test_kernel_equals_reference(m, block, layout):
    x, q, scale = case(m, m, 256, 256, block)
    qs = q.T if layout == "nk" else q
    got = wm.w8a8_matmul(x, qs, scale, layout=layout, block_m=64, block_n=128, block_k=128,
                         interpret=True)
    assert got.shape == (m, 256) and got.dtype == jnp.bfloat16
    want = qr.w8a8_reference(x, q, scale)
    assert rel_err(got, want) <= 1e-3
    assert rel_err(qr.w8a8_reference(x, qs, scale, layout=layout), want) == 0
    # XLA's FP8 dot in the same layout (writing a bf16 product with one scale a channel), and
    # the same math in float32 against the plain dequantized product (the activations'
    # quantization costs ~1e-2 there, not more)
    product = jnp.bfloat16 if block is None else jnp.float32
    assert rel_err(qr.w8a8_matmul(x, qs, scale, layout=layout),
                   qr.w8a8_reference(x, q, scale, product=product)) <= 1e-3
    assert rel_err(want, x.astype(jnp.float32) @ qr.dequantize_matrix(q, scale)) <= 0.05


def test_mosaic_kernel_equals_reference():
    x, q, scale = case(5, 96, 256, 256)  # two 64-row tiles, the second padded
    got = w8a8_mgpu.w8a8_matmul(x, q.T, scale, block_m=64, block_n=128, block_k=128,
                                num_stages=2, interpret=True)
    assert got.shape == (96, 256) and got.dtype == jnp.bfloat16
    assert rel_err(got, qr.w8a8_reference(x, q, scale)) <= 1e-3
    assert "scale groups" in w8a8_mgpu.supported(96, 256, 256, 2)


def test_kernel_refuses_what_it_cannot_tile():
    x, q, scale = case(0, 64, 256, 192)
    with pytest.raises(ValueError, match="block_n=128"):
        wm.w8a8_matmul(x, q, scale, block_n=128, interpret=True)
    assert "scale groups" in wm.supported(64, 256, 256, 4, block_k=128)  # groups of 64 rows
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        wm.w8a8_matmul_quantized(x, jnp.ones((64, 1)), q, scale, interpret=True)


def test_quant_matmul_routes_w8a8(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_SAID", set())  # every fallback message is said here
    x, q, scale = case(1, 64, 256, 256, (128, 128))
    want = qr.w8a8_reference(x, q, scale)
    for impl in ("xla", "pallas"):
        got = kernels.quant_matmul(x, q, scale, mode="w8a8", w8a8=impl, block_n=128,
                                   interpret=True)
        assert rel_err(got, want) <= 1e-3
    monkeypatch.setenv("PALLASITE_W8A8_IMPL", "pallas")
    assert kernels.w8a8_impl(x, q, scale, interpret=True) == "pallas"
    # a call's choice beats the variable
    assert kernels.w8a8_impl(x, q, scale, "xla", interpret=True) == "xla"
    # groups of 64 rows are not whole 128-row steps: XLA takes the call, and says so
    x2, q2, s2 = case(2, 64, 256, 256, (64, 128))
    assert kernels.w8a8_impl(x2, q2, s2, interpret=True) == "xla"
    assert "XLA's FP8 dot runs it" in caplog.text
    got = kernels.quant_matmul(x2, q2, s2, mode="w8a8", interpret=True)
    assert rel_err(got, qr.w8a8_reference(x2, q2, s2)) <= 1e-3
    # the Mosaic GPU kernel reads [N, K] weights only
    assert kernels.w8a8_impl(x, q, scale, "mosaic", interpret=True) == "xla"
    assert "it reads [N, K]" in caplog.text
    blockwise = kernels.w8a8_impl(x, q.T, scale, "mosaic", layout="nk", interpret=True)
    assert blockwise == "xla"
    x3, q3, s3 = case(3, 64, 256, 256)
    assert kernels.w8a8_impl(x3, q3.T, s3, "mosaic", layout="nk", interpret=True) == "mosaic"
    assert kernels.w8a8_impl(x3, q3.T, s3, "mosaic", layout="nk") == "xla"  # CPU, compiled
    got = kernels.quant_matmul(x3, q3.T, s3, mode="w8a8", w8a8="mosaic", layout="nk",
                               block_m=64, num_stages=2, interpret=True)
    assert rel_err(got, qr.w8a8_reference(x3, q3, s3)) <= 1e-3
    monkeypatch.setenv("PALLASITE_W8A8_IMPL", "cublas")
    with pytest.raises(ValueError, match="'xla', 'pallas', 'mosaic'"):
        kernels.quant_matmul(x, q, scale, mode="w8a8")
    with pytest.raises(ValueError, match="layout 'mn'"):
        kernels.quant_matmul(x, q, scale, mode="w8a16", layout="mn")
    got = kernels.quant_matmul(x, q.T, scale, mode="w8a16", layout="nk", interpret=True)
    assert rel_err(got, qr.w8a16_reference(x, q, scale)) <= 1e-3


@pytest.mark.parametrize("kernel,layout,groups,kw", [
    ("triton", "kn", 1, {}),
    ("triton", "nk", 4, dict(block_n=256, num_warps=4)),  # block-wise scales
    ("mosaic", "nk", 1, {}),                              # promoted per step
    ("mosaic", "nk", 1, dict(block_m=128, promote=False)),
])
def test_kernels_lower_for_the_gpu(kernel, layout, groups, kw):
    """Both kernels' lowering for CUDA without a GPU (Triton IR; Mosaic GPU's TMA, tiling and
    the FP8 wgmma that interpret mode replaces), though not the final compile."""
    m, k, n = 192, 512, 512
    f8 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    q = f8(n, k) if layout == "nk" else f8(k, n)
    if kernel == "triton":
        traced = wm.w8a8_matmul_quantized.trace(f8(m, k), f32(m, 1), q, f32(groups, n),
                                                layout=layout, **kw)
    else:
        traced = w8a8_mgpu.w8a8_matmul_quantized.trace(f8(m, k), f32(m, 1), q, f32(1, n), **kw)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert ("triton" if kernel == "triton" else "mosaic_gpu") in text


def test_banded_program_order_covers_every_tile_once():
    for rows, cols, group_m in [(3, 2, 2), (5, 7, 3), (16, 48, 8), (1, 4, 8)]:
        tiles = [tuple(int(v) for v in wm._banded(jnp.int32(p), rows=rows, cols=cols,
                                                    group_m=group_m))
                 for p in range(rows * cols)]
        assert sorted(tiles) == [(i, j) for i in range(rows) for j in range(cols)]
        assert tiles[1] == (min(1, rows - 1), 0 if rows > 1 else 1)  # down the band first
