"""The weight-only integer matmul (W4A16, W8A16) in Pallas interpret mode against its jnp
reference and against a plain numpy dequantization: odd M, group sizes 32/64/128 and
channel-wise, zero points, act-order permutation, split-K, K not a multiple of the tile."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.kernels import w4a16_matmul as im


def random_weight(rng, k, n, bits, group_size, asym):
    groups = -(-k // group_size)
    codes = rng.integers(0, 2 ** bits, size=(k, n))
    scale = rng.uniform(0.5, 1.5, size=(groups, n)).astype(np.float32) / 2 ** bits
    zero = rng.integers(0, 2 ** bits, size=(groups, n)).astype(np.float32) if asym else None
    return codes, scale, zero


def numpy_dequant(codes, scale, zero, bits, group_size):
    rows = np.arange(codes.shape[0]) // group_size
    z = 2 ** (bits - 1) if zero is None else zero[rows]
    return (codes - z) * scale[rows]


def test_pack_round_trip():
    rng = np.random.default_rng(0)
    for bits in (4, 8):
        codes = rng.integers(0, 2 ** bits, size=(300, 16))
        words = im.pack(codes, bits)
        assert words.dtype == np.int32 and words.shape == (im.padded_k(300, bits) * bits // 32, 16)
        np.testing.assert_array_equal(im.unpack(jnp.asarray(words), bits, 300), codes)


@pytest.mark.parametrize("m,k,n,bits,group,asym,perm,splits", [
    (1, 512, 128, 4, 128, False, False, 2),
    (5, 512, 128, 4, 32, True, False, 1),
    (33, 768, 128, 4, 64, True, True, 3),    # act order, 3 tiles in 3 splits
    (7, 320, 128, 4, 320, True, False, 2),   # channel-wise; K padded to the 512-row tile
    (3, 256, 128, 8, 128, False, False, 2),
    (17, 384, 128, 8, 64, True, True, 1),
])
def test_kernel_equals_reference_and_numpy(m, k, n, bits, group, asym, perm, splits):
    rng = np.random.default_rng(m * k + bits)
    codes, scale, zero = random_weight(rng, k, n, bits, group, asym)
    w = numpy_dequant(codes, scale, zero, bits, group)  # [K, N] in the sorted (packed) order
    order = rng.permutation(k) if perm else None
    words, s, z, g = im.pack_weight(codes, scale, zero, bits=bits, group_size=group)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    xs = np.asarray(x, np.float32)[:, order] if perm else np.asarray(x, np.float32)
    want = xs @ w
    kw = dict(bits=bits, group_size=g)
    ref = im.int_matmul_reference(x, jnp.asarray(words), s, z, order, **kw)
    got = im.int_matmul(x, jnp.asarray(words), s, z, order, num_splits=splits, interpret=True,
                        **kw)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    scale_of = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(ref, np.float32), want, atol=1e-2 * scale_of)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1e-2 * scale_of)


def test_bad_group_size_is_refused():
    with pytest.raises(ValueError, match="group_size=48"):
        im.pack_weight(np.zeros((512, 16), np.int32), np.ones((11, 16)), None, bits=4,
                       group_size=48)


@pytest.mark.parametrize("shape,lead,mode", [
    ((384, 256), 0, "w4a16"),       # K padded to the 512-row tile, a group of pad scales
    ((512, 3, 64), 0, "w4a16"),     # several output axes
    ((4, 256, 128), 1, "w4a16"),    # stacked experts, each its own scales
    ((320, 64), 0, "w8a16"),        # channel-wise
])
def test_quantize_on_load_is_rtn_packed(shape, lead, mode):
    """The weight quantized where it lies (one jitted program) against numpy's RTN and the
    kernel's packing: codes that differ only where a value sits on a rounding tie (XLA
    divides by multiplying with the reciprocal), scales to float32 rounding."""
    from pallasite.model import quant_int as qi
    rng = np.random.default_rng(len(shape) + lead)
    w = jnp.asarray(rng.normal(size=shape) * 0.02, jnp.bfloat16)
    got = qi.quantize_weight(w, 1, mode, lead=lead)
    bits, group = qi.MODES[mode]
    k = shape[lead]
    mats = np.asarray(w, np.float32).reshape(-1, k, int(np.prod(shape[lead + 1:])))
    lins = [qi.quantize_rtn(m, bits=bits, group_size=group if k % max(group, 1) == 0 else -1)
            for m in mats]
    want = qi.pack_experts(lins, shape, 1) if lead else qi.pack_linear(lins[0], shape, 1)
    assert (got.shape, got.group_size, got.lead) == (want.shape, want.group_size, want.lead)
    np.testing.assert_allclose(np.asarray(got.scale), np.asarray(want.scale), rtol=1e-6)
    codes = lambda p: np.asarray(im.unpack(p.words.reshape(-1, p.words.shape[-1]), bits))
    diff = np.abs(codes(got).astype(int) - codes(want).astype(int))
    assert diff.max() <= 1 and diff.mean() < 5e-3
