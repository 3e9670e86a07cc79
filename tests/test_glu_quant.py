"""SwiGLU between two W8A8 products (`kernels/glu_quant.py`, `kernels.w8a8_glu`): the kernel in
Pallas's interpreter against its jnp reference, the fused MLP against the two products it
replaces, and the model taking it for fused FP8 and INT8 weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite import kernels
from pallasite.kernels import glu_quant, quant_reference as qr
from pallasite.model import config_from_dict, forward_logits, init_params, quant
from pallasite.model.fuse import fuse_params

EIGHT = [jnp.float8_e4m3fn, jnp.int8]


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def product(seed, M, F, dtype):
    k = jax.random.split(jax.random.key(seed), 3)
    p = jax.random.normal(k[0], (M, 2, F)) * 40
    p = jnp.round(p).astype(jnp.int32) if dtype == jnp.int32 else p.astype(dtype)
    rs = (jax.random.uniform(k[1], (M, 1)) + 0.05).at[M // 2].set(0.0)  # a zero row
    cs = jax.random.uniform(k[2], (2, F)) * 0.02 + 0.001
    return p, rs, cs


@pytest.mark.parametrize("out", EIGHT)
def test_kernel_equals_reference(out):
    """Odd rows, a row of zeros (scale 1), F in three pieces of 128; float8 from a bf16
    product, int8 from an int32 one."""
    p, rs, cs = product(0, 5, 384, jnp.bfloat16 if out == jnp.float8_e4m3fn else jnp.int32)
    hq, hs = glu_quant.glu_quantize(p, rs, cs, out=out, interpret=True)
    rq, rsc = glu_quant.glu_quantize_reference(p, rs, cs, out=out)
    assert hq.dtype == out and hq.shape == (5, 384) and hs.shape == (5, 1)
    np.testing.assert_allclose(hs, rsc, rtol=1e-6)
    assert float(hs[2, 0]) == 1.0 and not np.any(np.asarray(hq[2], np.float32))
    same = np.asarray(hq, np.float32) == np.asarray(rq, np.float32)
    assert same.mean() > 0.999  # a value on a rounding edge may land one step over
    assert rel_err(hq.astype(jnp.float32) * hs, rq.astype(jnp.float32) * rsc) < 1e-3
    # what the reference computes is silu(gate) * up quantized per row
    y = p.astype(jnp.float32) * rs[:, :, None] * cs[None]
    h = jax.nn.silu(y[:, 0]) * y[:, 1]
    want = (qr.quantize_rows if out == jnp.float8_e4m3fn else qr.quantize_rows_int8)(h)
    assert rel_err(rq.astype(jnp.float32) * rsc, want[0].astype(jnp.float32) * want[1]) < 1e-3


def test_kernel_refuses_bad_shapes():
    p, rs, cs = product(0, 4, 128, jnp.bfloat16)
    with pytest.raises(ValueError, match="p \\[M, 2, F\\]"):
        glu_quant.glu_quantize(p, rs, cs[:1], interpret=True)
    with pytest.raises(ValueError, match="float8_e4m3fn or int8"):
        glu_quant.glu_quantize(p, rs, cs, out=jnp.bfloat16, interpret=True)


def weights(seed, d, f, scheme):
    """A gate/up [d, 2f] and a down [f, d] weight quantized per output channel, stored [N, K]
    as the model stores 8-bit weights: each as `kernels.quant_matmul`'s operands."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    out = []
    for key, (K, N) in ((k1, (d, 2 * f)), (k2, (f, d))):
        w = quant.quantize_linear(jax.random.normal(key, (K, N)) * K ** -0.5, (0, 1), scheme)
        out.append(quant.operands(quant.to_k_last(w, 1), 1))
    return out


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_fused_mlp_equals_two_products(scheme):
    d, f = 256, 384
    gu, dn = weights(1, d, f, scheme)
    x = jax.random.normal(jax.random.key(2), (7, d)).astype(jnp.bfloat16)
    got = kernels.w8a8_glu(x, gu, dn, mode="w8a8", interpret=True)
    same_math = kernels.w8a8_glu(x, gu, dn, mode="w8a8")  # on CPU: the jnp reference
    y = kernels.quant_matmul(x, *gu[:3], mode="w8a8", layout=gu[3]).reshape(7, 2, f)
    two = kernels.quant_matmul(jax.nn.silu(y[:, 0]) * y[:, 1], *dn[:3], mode="w8a8",
                               layout=dn[3])
    assert got.dtype == x.dtype and got.shape == (7, d)
    assert rel_err(got, same_math) < 2e-3
    assert rel_err(got, two) < 3e-2  # two's gate, up and h rounded to bf16 on the way


def test_fused_mlp_declines_what_it_does_not_fuse():
    d, f = 256, 384
    gu, dn = weights(1, d, f, "fp8")
    x = jnp.ones((4, d), jnp.bfloat16)
    assert kernels.w8a8_glu(x, gu, dn, mode="w8a16") is None  # weight-only sizes
    blocks = (gu[0], jnp.ones((2, 2 * f)), None, gu[3])  # two scale groups along K
    assert kernels.w8a8_glu(x, blocks, dn, mode="w8a8") is None
    zeros = (dn[0], dn[1], jnp.zeros_like(dn[1]), dn[3])
    assert kernels.w8a8_glu(x, gu, zeros, mode="w8a8") is None
    int8_down = weights(1, d, f, "int8")[1]
    assert kernels.w8a8_glu(x, gu, int8_down, mode="w8a8") is None  # mixed kinds
    odd = weights(1, d, 200, "fp8")  # F not in pieces of 128
    assert kernels.w8a8_glu(x, *odd, mode="w8a8") is None


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_model_takes_the_fused_mlp(scheme, monkeypatch):
    """Fused 8-bit weights at W8A8 sizes run their MLPs through `kernels.w8a8_glu`, and the
    logits stay those of the weights apart."""
    config = config_from_dict(dict(
        model_type="llama", vocab_size=128, hidden_size=256, intermediate_size=384,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64))
    apart = quant.quantize_params(init_params(config, seed=3), scheme)
    ids = np.random.default_rng(0).integers(0, 128, (2, 12))
    monkeypatch.setenv("PALLASITE_QUANT_MATMUL", "w8a8")
    want = forward_logits(apart, config, ids)
    calls = []
    real = kernels.w8a8_glu
    monkeypatch.setattr(kernels, "w8a8_glu", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = forward_logits(fuse_params(apart), config, ids)
    assert len(calls) == config.num_layers
    assert rel_err(got, want) < 2e-2
