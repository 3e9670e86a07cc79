"""The few-row integer product on the Hopper layout's words (`kernels/w4a16_gemv.py`) in Pallas
interpret mode against a plain numpy dequantization: INT4 and INT8, symmetric and with zero
points, groups smaller than, equal to and larger than a K tile, channel-wise, K padded to the
tile, split-K, several rows, act-order; and the library's choice of it: one row of the forms
run on the GPU (INT4 in groups of 128 with or without zero points, INT8 in groups of 128)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite import kernels
from pallasite.kernels import w4a16_gemv as gv
from pallasite.kernels import w4a16_matmul as im
from pallasite.kernels import w4a16_mgpu as mg
from tests.test_w4a16_matmul import numpy_dequant, random_weight

CASES = [  # m, k, n, bits, group_size, asym, blocks
    (1, 512, 64, 4, 128, False, dict(num_splits=2)),
    (3, 512, 64, 4, 128, True, dict(num_splits=2, tiles_step=2)),
    (2, 300, 64, 4, 32, True, dict(tiles_step=2)),  # K padded; four groups a tile
    (1, 384, 32, 4, 64, False, dict(block_n=32, tiles_step=4)),  # a step of three tiles: two
    (1, 1024, 32, 4, 256, False, dict(block_n=16, num_splits=2)),  # two tiles a group
    (2, 512, 64, 8, 128, True, dict(num_splits=2)),  # INT8: two 64-row tiles a group
    (1, 256, 64, 8, 128, True, dict(num_splits=4)),  # a split of one tile, half a group
    (1, 512, 64, 8, 512, False, dict(num_splits=4)),  # channel-wise
    (1, 512, 64, 4, 512, True, dict(num_splits=4, tiles_step=1)),
]


@pytest.mark.parametrize("unpack", ["mask", "one_plus"])
@pytest.mark.parametrize("m,k,n,bits,group_size,asym,blocks", CASES)
def test_matches_numpy(m, k, n, bits, group_size, asym, blocks, unpack):
    """Both ways codes become floats: masked in place (the default) and a shift a code."""
    rng = np.random.default_rng(m + k + bits)
    codes, scale, zero = random_weight(rng, k, n, bits, group_size, asym)
    _, s, z, g = im.pack_weight(codes, scale, zero, bits=bits, group_size=group_size)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = x.astype(jnp.bfloat16).astype(np.float32) @ numpy_dequant(codes, scale, zero, bits,
                                                                     group_size)
    got = gv.int_gemv_t(jnp.asarray(x, jnp.bfloat16), mg.pack_t(codes, bits), s, z, bits=bits,
                        group_size=g, unpack=unpack, interpret=True, **blocks)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    err = np.linalg.norm(np.asarray(got, np.float32) - want) / np.linalg.norm(want)
    assert err < 4e-3  # float32 sums of exact weights: only the output's bf16 rounding


def test_plan_keeps_steps_in_a_group_and_splits_whole():
    assert gv.plan(32, 1, 4, 4) == (4, 4)
    assert gv.plan(112, 1, 4, 8) == (8, 2)  # 14 tiles a split: a step of two
    assert gv.plan(8, 2, 4, 1) == (1, 2)  # a step inside its two-tile group
    assert gv.plan(8, 8, 4, 4) == (4, 2)  # one group: any split
    assert gv.plan(6, 2, 4, 4) == (3, 2)  # a split of 2 tiles, whole groups


@pytest.mark.parametrize("k,n,splits,step", [(4096, 6144, 8, 2), (4096, 28672, 8, 4),
                                              (14336, 4096, 28, 2), (4096, 4096, 8, 2)])
def test_tiles_give_each_program_four_k_tiles(k, n, splits, step):
    kw = gv.blocks_for(1, n, k // 128)
    assert gv.plan(k // 128, 1, kw["tiles_step"], kw["num_splits"]) == (splits, step)


def test_refuses_what_it_cannot_tile():
    assert not gv.supported(9, 64, bits=4, group_size=128, k_pad=256)  # too many rows
    assert not gv.supported(1, 64, bits=4, group_size=48, k_pad=256)
    assert gv.supported(1, 64, bits=4, group_size=256, k_pad=256)
    with pytest.raises(ValueError, match="block_n"):
        gv.int_gemv_t(jnp.zeros((1, 256), jnp.bfloat16), jnp.zeros((96, 32), jnp.int32),
                      jnp.ones((2, 96)), bits=4, group_size=128, block_n=64)


def test_library_takes_it_for_one_row_in_the_forms_run_on_the_gpu(monkeypatch):
    rng = np.random.default_rng(7)
    k, n = 256, 64
    codes, scale, _ = random_weight(rng, k, n, 4, 128, False)
    words, s, _, g = im.pack_weight(codes, scale, None, bits=4, group_size=128)
    perm = rng.permutation(k)
    calls = []
    real = gv.int_gemv_t
    monkeypatch.setattr(gv, "int_gemv_t", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for m in (1, 2):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        want = im.int_matmul_reference(x, words, s, None, perm, bits=4, group_size=g)
        got = kernels.int_matmul(x, mg.pack_t(codes, 4), s, None, perm, bits=4, group_size=g,
                                 layout="nk16", interpret=True)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=2e-2, atol=2e-2)
    assert len(calls) == 1  # one row here, two rows on the MMA kernel
    zero = jnp.full(s.shape, 7.0, jnp.bfloat16)
    kernels.int_matmul(x[:1], mg.pack_t(codes, 4), s, zero, bits=4, group_size=g, layout="nk16",
                       interpret=True)
    assert len(calls) == 2  # zero points in groups of 128 (AWQ, GPTQ) too
    # only the forms run on the GPU: INT4 in groups of 128 with or without zero points, INT8
    takes = lambda bits, g, z=False: kernels._int_gemv_takes(
        1, jnp.zeros((n, k * bits // 32), jnp.int32), z, bits=bits, group_size=g)
    assert takes(4, 128) and takes(4, 128, True) and takes(8, 128)
    assert not takes(4, 256) and not takes(4, 32) and not takes(4, 64, True)
    assert not takes(8, 128, True)
    monkeypatch.setenv("PALLASITE_INT_GEMV", "0")
    assert not takes(4, 128)


@pytest.mark.parametrize("fused", [True, False])
def test_gpu_lowering_carries_the_fused_multiply_add(fused):
    """Lowered for the GPU (here on any machine): the products' multiply-adds are inline PTX
    fma.rn.f32 with `fused`, plain float arithmetic without; so are the codes' masks, one
    lop3.b32 each."""
    k, n = 512, 128
    w = mg.pack_t(np.random.default_rng(0).integers(0, 16, (k, n)), 4)
    args = (jnp.ones((1, k), jnp.bfloat16), w, jnp.ones((k // 128, n), jnp.float32))
    f = jax.jit(lambda x, w, s: gv.int_gemv_t(x, w, s, bits=4, group_size=128, fused=fused))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert ("fma.rn.f32" in text) == fused
    assert ("lop3.b32" in text) == fused
