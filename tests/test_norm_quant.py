"""RMSNorm into the W8A8 products' input (`kernels/norm_quant.py`, `kernels.norm_quantize`) and
the one-pass norm before other quantized products (`kernels.add_norm`): the kernel in Pallas's
interpreter against its jnp reference, the reference against the model's own norm and row
quantization, and the paged step taking each where it should."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite import kernels
from pallasite.kernels import norm_quant, quant_reference as qr
from pallasite.model import config_from_dict, forward_logits, init_kv_cache, init_params, quant
from pallasite.model.fuse import fuse_params
from pallasite.model.layers import RMSNorm

from test_model import paged_step

EIGHT = [jnp.float8_e4m3fn, jnp.int8]


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def stream(seed, M, D):
    k = jax.random.split(jax.random.key(seed), 3)
    x = (jax.random.normal(k[0], (M, D)) * 3).at[M // 2].set(0.0)  # a zero row: scale 1
    res = (jax.random.normal(k[1], (M, D))).at[M // 2].set(0.0)
    w = jax.random.uniform(k[2], (D,)) + 0.5
    return x.astype(jnp.bfloat16), res.astype(jnp.bfloat16), w.astype(jnp.bfloat16)


@pytest.mark.parametrize("out", EIGHT)
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("plus_one", [False, True])
def test_kernel_equals_reference(out, add, plus_one):
    """Odd rows, a zero row, D in three pieces of 128; with and without the residual sum, and
    Gemma's (1 + weight)."""
    x, res, w = stream(0, 5, 384)
    res = res if add else None
    kw = dict(eps=1e-5, plus_one=plus_one, out=out)
    q, s, total = norm_quant.norm_quantize(x, w, res, interpret=True, **kw)
    rq, rs, rtotal = norm_quant.norm_quantize_reference(x, w, res, **kw)
    assert q.dtype == out and q.shape == (5, 384) and s.shape == (5, 1)
    np.testing.assert_allclose(s, rs, rtol=1e-5)
    assert float(s[2, 0]) == 1.0 and not np.any(np.asarray(q[2], np.float32))
    same = np.asarray(q, np.float32) == np.asarray(rq, np.float32)
    assert same.mean() > 0.999  # a value on a rounding edge may land one step over
    assert rel_err(q.astype(jnp.float32) * s, rq.astype(jnp.float32) * rs) < 2e-3
    if add:
        assert total.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(total, np.float32), np.asarray(rtotal,
                                                                                np.float32))
        np.testing.assert_array_equal(np.asarray(total, np.float32),
                                      np.asarray(x + res, np.float32))
    else:
        assert total is None and rtotal is None


@pytest.mark.parametrize("out", EIGHT)
def test_reference_is_the_models_norm_then_quantize(out):
    """The reference is op for op the model's `RMSNorm` and `quantize_rows`: the same bits."""
    x, res, w = stream(1, 6, 256)
    norm = RMSNorm(256, 1e-6, jnp.bfloat16)
    h = norm.apply({"params": {"scale": w}}, x + res)
    want = (qr.quantize_rows if out == jnp.float8_e4m3fn else qr.quantize_rows_int8)(h)
    q, s, _ = norm_quant.norm_quantize_reference(x, w, res, eps=1e-6, out=out)
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(s, want[1])
    rows, total = norm.apply({"params": {"scale": w}}, x, res, rows8=out)
    assert isinstance(rows, qr.Rows8) and rows.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(rows.q, np.float32), np.asarray(q, np.float32))
    np.testing.assert_array_equal(np.asarray(total, np.float32), np.asarray(x + res,
                                                                            np.float32))


@pytest.mark.parametrize("out", EIGHT)
def test_kernel_scales_a_product_as_its_residual(out):
    """The residual as a W8A8 product before its scales (bf16 from FP8, int32 from INT8): the
    kernel's sum is the stream plus `Product.value()`, and `kernels.norm_quantize` takes the
    `Product` whole."""
    x, _, w = stream(2, 7, 384)
    k = jax.random.split(jax.random.key(5), 3)
    raw = jax.random.normal(k[0], (7, 384)) * 50
    raw = raw.astype(jnp.bfloat16) if out == jnp.float8_e4m3fn else jnp.round(raw).astype(
        jnp.int32)
    rows = jax.random.uniform(k[1], (7, 1)) * 0.01 + 1e-3
    cols = jax.random.uniform(k[2], (1, 384)) * 0.01 + 1e-3
    product = qr.Product(raw, rows, cols, x.dtype)
    kw = dict(eps=1e-5, out=out)
    q, s, total = norm_quant.norm_quantize(x, w, raw, (rows, cols[0]), interpret=True, **kw)
    want_total = x + product.value()
    np.testing.assert_array_equal(np.asarray(total, np.float32),
                                  np.asarray(want_total, np.float32))
    rq, rs, _ = norm_quant.norm_quantize_reference(x, w, product.value(), **kw)
    assert (np.asarray(q, np.float32) == np.asarray(rq, np.float32)).mean() > 0.999
    np.testing.assert_allclose(s, rs, rtol=1e-5)
    rows8, summed = kernels.norm_quantize(x, w, product, interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(rows8.q, np.float32), np.asarray(q, np.float32))
    np.testing.assert_array_equal(np.asarray(summed, np.float32), np.asarray(total, np.float32))
    with pytest.raises(ValueError, match="residual_scales"):
        norm_quant.norm_quantize(x, w, raw, (rows, cols), interpret=True, **kw)


def test_kernel_refuses_bad_operands():
    x, res, w = stream(0, 4, 128)
    with pytest.raises(ValueError, match="weight \\[D\\]"):
        norm_quant.norm_quantize(x, w[:64], eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="residual"):
        norm_quant.norm_quantize(x, w, res[:2], eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="float8_e4m3fn or int8"):
        norm_quant.norm_quantize(x, w, eps=1e-5, out=jnp.bfloat16, interpret=True)


def test_rows_go_only_where_the_product_takes_them():
    """Which products take rows made by the norm, and that a product refuses rows it would
    not have quantized so."""
    w = quant.quantize_linear(jax.random.normal(jax.random.key(0), (128, 256)), (0, 1), "fp8")
    w8 = quant.quantize_linear(jax.random.normal(jax.random.key(0), (128, 256)), (0, 1), "int8")
    x = jnp.ones((16, 128), jnp.bfloat16)
    assert quant.rows8_for(x, w) is None  # CPU: these sizes run W8A16 here
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PALLASITE_QUANT_MATMUL", "w8a8")
        assert quant.rows8_for(x, w, w) == jnp.float8_e4m3fn
        assert quant.rows8_for(x, w8) == jnp.int8
        assert quant.rows8_for(x, w, w8) is None  # two kinds: one x cannot feed both
        assert quant.rows8_for(x, w, jnp.ones((128, 256))) is None  # a plain weight
        assert quant.rows8_for(x) is None
        mp.setenv("PALLASITE_W8A8_NORM", "0")
        assert quant.rows8_for(x, w) is None
    rows = qr.Rows8(*qr.quantize_rows(x), x.dtype)
    with pytest.raises(ValueError, match="does not take them"):
        quant.linear(rows, w)  # W8A16 sizes on CPU


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_unscaled_products_are_the_products(scheme):
    """A W8A8 product handed back before its scales is, scaled, the product's bits; a W8A16 one
    comes back as the product itself."""
    w = quant.quantize_linear(jax.random.normal(jax.random.key(0), (128, 256)), (0, 1), scheme)
    ops = quant.operands(w, 1)
    x = jax.random.normal(jax.random.key(1), (9, 128)).astype(jnp.bfloat16)
    call = lambda **k: kernels.quant_matmul(x, *ops[:3], layout=ops[3], **k)
    held = call(mode="w8a8", unscaled=True)
    assert isinstance(held, qr.Product) and held.p.dtype == (
        jnp.int32 if scheme == "int8" else jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(held.value(), np.float32),
                                  np.asarray(call(mode="w8a8"), np.float32))
    assert held.reshape(3, 3, 256).value().shape == (3, 3, 256)
    plain = call(mode="w8a16", unscaled=True)
    assert not isinstance(plain, qr.Product) and plain.shape == (9, 256)


def llama(hidden=256):
    return config_from_dict(dict(
        model_type="llama", vocab_size=128, hidden_size=hidden, intermediate_size=384,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64))


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
@pytest.mark.parametrize("fused", [False, True])
def test_paged_step_takes_the_norm_kernel(scheme, fused, monkeypatch):
    """8-bit weights at W8A8 sizes: both norms of every layer hand their products quantized
    rows, apart or fused weights alike, and take the products before them unscaled (the
    attention's output, and the last layer's MLP). With the jnp reference the logits are the
    bits of the step without it; with the kernel interpreted, within its summation order."""
    config = llama()
    params = quant.quantize_params(init_params(config, seed=3, dtype=jnp.bfloat16), scheme)
    params = fuse_params(params) if fused else params
    rng = np.random.default_rng(0)
    chunks = [(0, rng.integers(0, 128, 9), 0), (1, rng.integers(0, 128, 6), 0)]
    tables = [np.arange(8), np.arange(8, 16)]
    monkeypatch.setenv("PALLASITE_QUANT_MATMUL", "w8a8")

    def step(norm):
        monkeypatch.setenv("PALLASITE_W8A8_NORM", norm)
        kv = init_kv_cache(config, 16, 4, jnp.bfloat16)
        return paged_step(params, config, kv, chunks, tables, 4)[0]

    want = step("0")
    np.testing.assert_array_equal(step("1"), want)
    calls = []
    real = kernels.norm_quantize
    monkeypatch.setattr(kernels, "norm_quantize", lambda x, w, res=None, **k: calls.append(
        (k["out"], type(res).__name__)) or real(x, w, res, interpret=True, **k))
    got = step("1")
    out = jnp.dtype(jnp.int8 if scheme == "int8" else jnp.float8_e4m3fn)
    assert calls == [(out, "NoneType"), (out, "Product"), (out, "Product"), (out, "Product")]
    assert rel_err(got, want) < 1e-3


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_paged_step_adds_and_norms_in_one_pass(dtype, monkeypatch):
    """Quantized weights at weight-only sizes (W8A16 on CPU): each norm of the paged step adds
    the output before it in its pass and writes the norm unquantized (the kernel interpreted),
    with the logits of XLA's passes. Plain weights and the dense forward keep XLA's norms."""
    config = llama()
    plain = init_params(config, seed=3, dtype=dtype)
    params = quant.quantize_params(plain, "fp8")
    calls = []
    real = kernels.norm_quantize
    monkeypatch.setattr(kernels, "norm_quantize", lambda x, w, res=None, **k: calls.append(
        (k["out"], res is None)) or real(x, w, res, **(k | dict(interpret=True))))

    def step(params, one_pass="1"):
        monkeypatch.setenv("PALLASITE_ADD_NORM", one_pass)
        kv = init_kv_cache(config, 16, 4, dtype)
        return paged_step(params, config, kv, [(0, np.arange(5), 0), (1, np.arange(7), 0)],
                          [np.arange(8), np.arange(8, 16)], 4)[0]

    want = step(params, "0")
    assert not calls
    got = step(params)
    assert calls == [(None, True)] + [(None, False)] * (2 * config.num_layers - 1)
    assert rel_err(got, want) < (1e-5 if dtype == jnp.float32 else 1e-3)
    calls.clear()
    step(plain)
    forward_logits(params, config, np.arange(6)[None])
    assert not calls


def test_reference_path_is_the_bits_of_xlas_passes(monkeypatch):
    """Where no kernel runs (CPU), the one-pass norms are XLA's ops: the same logits."""
    config = llama()
    params = quant.quantize_params(init_params(config, seed=4, dtype=jnp.bfloat16), "fp8")

    def step(one_pass):
        monkeypatch.setenv("PALLASITE_ADD_NORM", one_pass)
        kv = init_kv_cache(config, 16, 4, jnp.bfloat16)
        return paged_step(params, config, kv, [(0, np.arange(6), 0)], [np.arange(8)], 4)[0]

    np.testing.assert_array_equal(step("1"), step("0"))
