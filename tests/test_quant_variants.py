"""The quantized matmuls' tuning variants (interpret mode) against their jnp references: the
W8A16 kernel's f16 MMA and one-row multiply-and-sum, the INT4 kernel's bit-pattern unpack (zero
taken off after the dot), one-row sum and per-group forms; the tuned-tiles table; and W8A8's FP8 dot without
fast accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.kernels import quant_reference as qr
from pallasite.kernels import tuning
from pallasite.kernels import w4a16_matmul as im
from pallasite.kernels import w8a16_matmul as wm


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("m,kw", [
    (1, dict(reduce="sum")), (3, dict(dot_dtype="float16")), (5, dict(swap=True)),
    (1, dict(reduce="acc")),                                 # one sum after the loop
    (1, dict(reduce="acc", layout="nk")), (1, dict(reduce="sum", layout="nk")),
    (3, dict(layout="nk")), (5, dict(swap=True, layout="nk")),  # weights stored [N, K]
    (3, dict(reduce="sum", layout="nk")), (2, dict(reduce="sum")),
    (2, dict(reduce="acc", layout="nk"))])  # rows one at a time
def test_w8a16_variants_equal_reference(m, kw):
    rng = np.random.default_rng(m)
    k, n = 512, 128
    w = rng.normal(size=(k, n)).astype(np.float32)
    scale = np.abs(w).reshape(2, k // 2, n).max(1) / 448
    q = jnp.asarray(w / np.repeat(scale, k // 2, 0)).astype(jnp.float8_e4m3fn)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    stored = jnp.asarray(q.T, copy=True) if kw.get("layout") == "nk" else q
    got = wm.w8a16_matmul(x, stored, jnp.asarray(scale), block_n=64, block_k=128, split_k=2,
                          interpret=True, **kw)
    assert got.shape == (m, n)
    assert rel_err(got, qr.w8a16_reference(x, q, jnp.asarray(scale))) <= 1e-3


def test_w8a16_row_sums_take_few_rows():
    with pytest.raises(ValueError, match="'sum' and 'acc' take M <= 8"):
        wm.w8a16_matmul(jnp.zeros((9, 128), jnp.bfloat16), jnp.zeros((128, 64), jnp.int8),
                        jnp.ones((1, 64)), reduce="acc", interpret=True)


@pytest.mark.parametrize("m,asym,kw", [
    (3, True, dict(unpack="magic")),                   # zeros after the dot
    (1, True, dict(reduce="sum")),                     # f32 bit patterns, no MMA
    (1, True, dict(reduce="acc")),                     # the same, summed once after the loop
    (2, False, dict(reduce="acc")),                    # two rows, each its own accumulator
    (3, True, dict(reduce="sum")),
    (2, True, dict(unpack="magic", swap=True)),        # w^T x^T, zeros after the dot
    (1, False, dict(unpack="magic", swap=True)),       # one row padded, the zero a constant
])
def test_int4_variants_equal_numpy(m, asym, kw):
    rng = np.random.default_rng(10 + m)
    k, n, g = 512, 128, 64
    codes = rng.integers(0, 16, (k, n))
    scale = rng.uniform(0.5, 1.5, (k // g, n)).astype(np.float32) / 16
    zero = rng.integers(0, 16, (k // g, n)).astype(np.float32) if asym else None
    words, s, z, g = im.pack_weight(codes, scale, zero, bits=4, group_size=g)
    rows = np.arange(k) // g
    w = (codes - (zero[rows] if asym else 8)) * scale[rows]
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    got = im.int_matmul(x, jnp.asarray(words), s, z, bits=4, group_size=g, block_n=64,
                        num_splits=2, interpret=True, **kw)
    want = np.asarray(x, np.float32) @ w
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1e-2 * np.abs(want).max())
    ref = im.int_matmul_reference(x, jnp.asarray(words), s, z, bits=4, group_size=g)
    assert rel_err(got, ref) <= 1e-3


@pytest.mark.parametrize("m,bits,k,group,asym,kw", [
    (1, 4, 512, 64, True, dict(reduce="acc_group")),          # two groups a tile
    (2, 4, 768, 384, False, dict(reduce="acc_group")),        # a group across tiles
    (3, 8, 512, 32, True, dict(reduce="acc_group")),          # a group a slab
    (1, 8, 320, 320, True, dict(reduce="acc_group")),         # channel-wise, K padded
    (5, 4, 512, 128, True, dict(reduce="dot_group", unpack="magic")),
    (4, 4, 768, 384, True, dict(reduce="dot_group", unpack="magic", swap=True)),
    (17, 8, 512, 64, True, dict(reduce="dot_group")),
    (3, 4, 512, 128, False, dict(reduce="dot_group", swap=True)),
])
def test_per_group_forms_equal_numpy(m, bits, k, group, asym, kw):
    """A group's slabs summed before its zero and scale: the same product as numpy's."""
    rng = np.random.default_rng(m * bits + k)
    n, groups = 128, -(-k // group)
    codes = rng.integers(0, 2 ** bits, (k, n))
    scale = rng.uniform(0.5, 1.5, (groups, n)).astype(np.float32) / 2 ** bits
    zero = rng.integers(0, 2 ** bits, (groups, n)).astype(np.float32) if asym else None
    words, s, z, g = im.pack_weight(codes, scale, zero, bits=bits, group_size=group)
    rows = np.arange(k) // group
    w = (codes - (zero[rows] if asym else 2 ** (bits - 1))) * scale[rows]
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    got = im.int_matmul(x, jnp.asarray(words), s, z, bits=bits, group_size=g, block_n=64,
                        num_splits=2, interpret=True, **kw)
    want = np.asarray(x, np.float32) @ w
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1e-2 * np.abs(want).max())
    ref = im.int_matmul_reference(x, jnp.asarray(words), s, z, bits=bits, group_size=g)
    assert rel_err(got, ref) <= 1e-3


def test_int4_magic_refuses_int8():
    words = jnp.zeros((32, 128), jnp.int32)
    with pytest.raises(ValueError, match="unpack='magic' takes 4 bits"):
        im.int_matmul_packed(jnp.zeros((16, 128), jnp.bfloat16), words, jnp.ones((1, 128)),
                             bits=8, group_size=128, unpack="magic", interpret=True)


def test_tuned_entries_are_used_where_they_fit(monkeypatch):
    fp8 = dict(block_m=16, block_n=128, block_k=512, split_k=4, num_warps=8)
    monkeypatch.setitem(tuning.QUANT_MATMUL, "w8a16", {
        (4096, 1024): [(16, fp8), (1, dict(fp8, reduce="sum", block_m=1))]})
    assert wm.blocks_for(1, 4096, 1024)["reduce"] == "sum"    # the smallest M that covers
    assert wm.blocks_for(8, 4096, 1024) == fp8
    assert wm.blocks_for(32, 4096, 1024)["block_m"] == 64     # past the entries: the rule
    assert wm.blocks_for(8, 4096, 1024, groups=32)["split_k"] == 4  # 32 groups split in 4
    assert wm.blocks_for(8, 4096, 1024, groups=2)["block_k"] == 256  # 2 do not: the rule
    monkeypatch.setitem(tuning.QUANT_MATMUL, "w4a16", {
        (512, 128): [(1, dict(block_n=64, num_splits=4, reduce="sum", unpack="magic"))]})
    assert im.params_for(1, 512, 128, 4)["num_splits"] == 4
    assert im.params_for(2, 512, 128, 4) == dict(block_n=128)


def test_w8a8_dot_does_not_accumulate_fast():
    """XLA enables cuBLASLt's FP8 fast accumulation for a DEFAULT-precision FP8 dot (2.4e-3
    off the float32 product of the same inputs at K=4096 on an H100); the W8A8 product asks
    for HIGHEST, which turns it off."""
    x = jnp.ones((32, 256), jnp.bfloat16)
    for groups in (1, 2):
        q, s = jnp.ones((256, 64), jnp.float8_e4m3fn), jnp.ones((groups, 64), jnp.float32)
        text = jax.jit(qr.w8a8_matmul).lower(x, q, s).as_text()
        dots = [line for line in text.splitlines() if "dot_general" in line]
        assert dots and all("f8E4M3FN" in d and "HIGHEST" in d for d in dots), dots
        fast = jax.jit(lambda *a: qr.w8a8_matmul(*a, fast=True)).lower(x, q, s).as_text()
        assert "HIGHEST" not in fast
