"""The Hopper W4A16/W8A16 kernel (dequantized weight as the MMA's register operand) in Pallas
interpret mode against a plain numpy dequantization: INT4 and INT8, symmetric and with zero
points, group sizes 32/128 and channel-wise, M padded to the tile, K padded to the packed tile,
split-K, and the act-order permutation."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.kernels import w4a16_matmul as im
from pallasite.kernels import w4a16_mgpu as mg
from tests.test_w4a16_matmul import numpy_dequant, random_weight

CASES = [  # m, k, n, bits, group_size, asym, splits, unpack, wait_every
    (5, 512, 128, 4, 128, False, 1, "fma", None),
    (20, 300, 64, 4, 32, True, 2, "fma", None),
    (3, 256, 64, 8, 32, True, 1, "fma", None),
    (9, 512, 64, 4, 512, False, 1, "magic", None),
    (17, 256, 64, 4, 64, True, 1, "convert", None),
    (4, 128, 64, 4, 128, False, 1, "fma", None),  # one K tile
    (1, 256, 64, 8, 128, True, 4, "fma", None),  # a split of one 64-row tile, half a group
    (20, 300, 64, 4, 32, True, 2, "fma", 2),  # MMAs awaited two planes at a time
    (3, 256, 64, 8, 32, True, 1, "fma", 8),  # more than INT8's four planes: all at once
]


def check(m, k, n, bits, group_size, asym, **blocks):
    rng = np.random.default_rng(m + k)
    codes, scale, zero = random_weight(rng, k, n, bits, group_size, asym)
    words, s, z, g = im.pack_weight(codes, scale, zero, bits=bits, group_size=group_size)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = x.astype(jnp.bfloat16).astype(np.float32) @ numpy_dequant(codes, scale, zero, bits,
                                                                     group_size)
    got = mg.int_matmul(jnp.asarray(x, jnp.bfloat16), mg.pack_t(codes, bits), s, z, bits=bits,
                        group_size=g, interpret=True, **blocks)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    err = np.linalg.norm(np.asarray(got, np.float32) - want) / np.linalg.norm(want)
    assert err < 1e-2  # each weight rounded to bf16, as dequantizing in the graph does


@pytest.mark.parametrize("m,k,n,bits,group_size,asym,splits,unpack,wait_every", CASES)
def test_matches_numpy(m, k, n, bits, group_size, asym, splits, unpack, wait_every):
    check(m, k, n, bits, group_size, asym, block_n=64, num_splits=splits, unpack=unpack,
          wait_every=wait_every)


@pytest.mark.parametrize("m,k,n,bits,group_size,asym,blocks", [
    (5, 256, 256, 4, 128, False, dict()),  # a ring as deep as the K tiles
    (20, 1024, 256, 4, 128, True, dict(num_splits=2, num_stages=3)),  # refills, split-K
    (20, 640, 256, 4, 32, True, dict()),  # five tiles through two slots, groups of 32
    (33, 512, 128, 8, 64, True, dict(block_m=16)),  # INT8, three row blocks
])
def test_two_consumers_match_numpy(m, k, n, bits, group_size, asym, blocks):
    """Two warpgroups a CTA over one shared activation tile, each its own half of the
    columns."""
    check(m, k, n, bits, group_size, asym, block_n=64, consumers=2, **blocks)


def test_two_consumers_only_where_their_shared_memory_fits():
    """Two warpgroups hold their ring and both output tiles at once: at 128 rows with float32
    partial sums, zero points (AWQ at g128) or groups of 64 tip them past an H100 CTA's shared
    memory, and one warpgroup takes the call."""
    assert mg.blocks_for(128, 4096, 112)["consumers"] == 2  # symmetric g128 fits
    for g, zero in [(128, True), (64, False)]:
        kw = mg.blocks_for(128, 4096, 112, group_size=g, zero_points=zero)
        assert "consumers" not in kw and kw["num_splits"] == 8
        why = mg.supported(128, 112 * 128, 4096, bits=4, group_size=g, zero_points=zero,
                           **mg.blocks_for(128, 4096, 112, 2))
        assert "shared memory" in why
    # the figure the GPU compiler gave for three stages (H100): 281648 bytes
    assert mg.shared_bytes(128, bits=4, group_size=128, block_n=128, consumers=2,
                           num_stages=3, f32_out=True, zero_points=False) == 281648


def test_two_consumers_race_free():
    """The interpreter's race detector over the shared ring: every refill lands in a slot
    both consumers have released."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    rng = np.random.default_rng(7)
    codes, scale, zero = random_weight(rng, 640, 256, 4, 128, True)
    _, s, z, g = im.pack_weight(codes, scale, zero, bits=4, group_size=128)
    x = jnp.asarray(rng.standard_normal((9, 640)), jnp.bfloat16)
    got = mg.int_matmul(x, mg.pack_t(codes, 4), s, z, bits=4, group_size=g, block_n=64,
                        consumers=2, interpret=InterpretGPUParams(detect_races=True))
    assert not gpu_callbacks.get_races().races_found
    want = np.asarray(x, np.float32) @ numpy_dequant(codes, scale, zero, 4, 128)
    assert np.linalg.norm(np.asarray(got, np.float32) - want) / np.linalg.norm(want) < 1e-2


def test_wide_column_tile():
    """256 output columns a CTA over 64-row blocks: the accumulator as large as 128 x 128's,
    each activation tile shared by twice the columns."""
    check(70, 256, 256, 4, 128, True, block_n=256, block_m=64)


@pytest.mark.parametrize("m,n,k_tiles,splits", [
    (64, 28672, 32, 1),  # 224 column blocks fill the SMs: a split would add a second wave
    (16, 28672, 32, 2),  # at 16 rows the split still paid
    (64, 6144, 32, 8),  # 48 blocks: split K
    (256, 4096, 112, 4),  # two row blocks of 32: two CTAs an SM
])
def test_blocks_for_splits_only_a_short_grid(m, n, k_tiles, splits):
    assert mg.blocks_for(m, n, k_tiles, consumers=1) == dict(block_n=128, num_splits=splits)


@pytest.mark.parametrize("m,n,k_tiles,want", [
    (256, 28672, 32, dict(num_splits=1, consumers=2)),  # 224 CTAs of 256 columns
    (256, 6144, 32, dict(num_splits=2, consumers=2)),  # 48 CTAs: 96 split, not 192
    (128, 4096, 112, dict(num_splits=8, consumers=2)),  # 16 CTAs: 128 split
    (32, 28672, 32, dict(num_splits=1)),  # one warpgroup a CTA below 64 rows
    (64, 6016, 32, dict(num_splits=8)),  # columns not in 256s: one warpgroup
])
def test_blocks_for_two_consumers_from_64_rows(m, n, k_tiles, want):
    """Two warpgroups a CTA from 64 rows, K split up to one CTA an SM."""
    assert mg.blocks_for(m, n, k_tiles) == dict(block_n=128, **want)


def test_act_order_permutation():
    rng = np.random.default_rng(1)
    m, k, n = 4, 256, 64
    codes, scale, _ = random_weight(rng, k, n, 4, 128, False)
    words, s, _, g = im.pack_weight(codes, scale, None, bits=4, group_size=128)
    perm = rng.permutation(k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    want = im.int_matmul_reference(x, words, s, None, perm, bits=4, group_size=g)
    got = mg.int_matmul(x, mg.pack_t(codes, 4), s, None, perm, bits=4, group_size=g,
                        block_n=64, interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=3e-2, atol=3e-2)


def test_pack_t_round_trip():
    codes = np.random.default_rng(2).integers(0, 16, size=(200, 64))
    words_t = mg.pack_t(codes, 4)
    assert words_t.shape == (64, 256 // 8)  # K padded to the 128-row tile
    np.testing.assert_array_equal(np.asarray(mg.unpack_t(words_t, 4, 200)), codes)


def test_refuses_what_it_cannot_tile():
    assert "block_n" in mg.supported(16, 256, 96, bits=4, group_size=128, block_n=64)
    assert "group_size" in mg.supported(16, 256, 64, bits=4, group_size=96, block_n=64)
    assert "2 x block_n" in mg.supported(16, 256, 192, bits=4, group_size=128, block_n=64,
                                          consumers=2)
    assert "consumers" in mg.supported(16, 256, 192, bits=4, group_size=128, consumers=3)
    assert mg.supported(300, 256, 128, bits=4, group_size=128) is None
    with pytest.raises(ValueError, match="block_n"):
        mg.int_matmul_t(jnp.zeros((4, 256), jnp.bfloat16), jnp.zeros((96, 32), jnp.int32),
                        jnp.ones((2, 96)), bits=4, group_size=128, block_n=64)


def test_model_in_the_hopper_layout_matches_the_triton_layout():
    """A W4A16 model's packed weights moved into the Hopper kernel's layout (as the engine does
    on an sm_90 GPU) and back: the same codes, the same logits, experts left as they are."""
    import copy

    from pallasite.model import config_from_dict, forward_logits, init_params, quant_int
    from pallasite.model.fuse import fuse_params
    config = config_from_dict(dict(
        model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        tie_word_embeddings=False))
    kn = fuse_params(quant_int.quantize_params(init_params(config, seed=3), "w4a16"))
    nk = quant_int.for_kernels(copy.deepcopy(kn), "nk16")
    qkv, experts = nk["layers_0"]["attn"]["wqkv"], nk["layers_0"]["moe"]["w_down"]
    assert qkv.layout == "nk16" and qkv.words.shape[0] == qkv.scale.shape[1]
    assert experts.layout == "kn"  # the grouped kernel's own layout
    back = quant_int.relayout(qkv, "kn")
    np.testing.assert_array_equal(np.asarray(back.words),
                                  np.asarray(kn["layers_0"]["attn"]["wqkv"].words))
    ids = np.random.default_rng(0).integers(0, 128, (2, 12))
    np.testing.assert_allclose(np.asarray(forward_logits(nk, config, ids)),
                               np.asarray(forward_logits(kn, config, ids)), rtol=1e-5, atol=1e-5)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 64)), jnp.bfloat16)
    from pallasite import kernels  # the Hopper kernel's call, as the engine makes it there
    got = kernels.int_matmul(x, qkv.words, qkv.scale, None, bits=4, group_size=qkv.group_size,
                             layout="nk16", interpret=True)
    want = x.astype(jnp.float32) @ back.dequantize().reshape(64, -1)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-2


def test_dequantize_t_is_the_transposed_weight():
    rng = np.random.default_rng(4)
    codes, scale, zero = random_weight(rng, 300, 64, 4, 32, True)
    _, s, z, g = im.pack_weight(codes, scale, zero, bits=4, group_size=32)
    got = mg.dequantize_t(mg.pack_t(codes, 4), s, z, bits=4, group_size=g, k=300)
    np.testing.assert_allclose(np.asarray(got).T, numpy_dequant(codes, scale, zero, 4, 32),
                               rtol=1e-6, atol=1e-6)


def test_every_form_the_hopper_kernel_tiles_moves_by_default(monkeypatch):
    """On an sm_90 GPU the engine moves INT4 and INT8 weights, symmetric or with zero points,
    into the Hopper layout; a weight whose columns it cannot tile keeps the Triton layout."""
    from pallasite import kernels
    from pallasite.model import quant_int
    monkeypatch.setattr(kernels, "int_layout", lambda: "nk16")
    rng = np.random.default_rng(5)

    def packed(bits, asym, n=64, group=128):
        codes, scale, zero = random_weight(rng, 256, n, bits, group, asym)
        lin = quant_int.IntLinear(codes, scale, zero, bits, group, None)
        return quant_int.pack_linear(lin, (256, n), 1)
    forms = {"sym4": packed(4, False), "asym4": packed(4, True), "sym8": packed(8, False),
             "asym8_g32": packed(8, True, group=32), "narrow": packed(4, False, n=96)}
    params = {"a": dict(forms)}
    quant_int.for_kernels(params)
    got = {k: params["a"][k].layout for k in forms}
    assert got == dict(sym4="nk_i4", asym4="nk16", sym8="nk16", asym8_g32="nk16", narrow="kn")
    assert params["a"]["sym4"].words.dtype == jnp.int4
    assert params["a"]["sym4"].nbytes == forms["sym4"].nbytes  # two codes a byte either way
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    for k in ("sym4", "asym4", "asym8_g32"):  # the moved weight multiplies as it did
        p, q = params["a"][k], forms[k]
        got = kernels.int_matmul(x, p.words, p.scale, p.zero, bits=p.bits,
                                 group_size=p.group_size, layout=p.layout, interpret=True)
        want = kernels.int_matmul(x, q.words, q.scale, q.zero, bits=q.bits,
                                  group_size=q.group_size, interpret=True)
        np.testing.assert_array_equal(np.asarray(p.dequantize()), np.asarray(q.dequantize()))
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2  # weights rounded to bf16


def test_engine_in_the_hopper_layout_generates_as_in_the_triton_layout(tmp_path, monkeypatch):
    """The engine places W4A16 weights in the layout `kernels.int_layout` names (the Hopper one,
    forced here on CPU, where the products run dequantized) and greedy outputs do not change."""
    import hf_models

    from pallasite import kernels
    from pallasite.serving.llm import LLM, SamplingParams
    hf_models.save("llama", tmp_path, config=dict(hidden_size=256, intermediate_size=256))
    kw = dict(quantization="w4a16", max_model_len=64, num_pages=32, page_size=8, max_num_seqs=2,
              max_num_batched_tokens=16, token_buckets=[1, 16], page_buckets=[8])
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 33, 2, 9], [7, 3, 3, 40]]
    outs = {}
    for layout, tiles, placed in (("kn", "1", "kn"), ("nk16", "0", "nk16"),
                                  ("nk16", "1", "nk_i4")):
        monkeypatch.setattr(kernels, "int_layout", lambda layout=layout: layout)
        monkeypatch.setenv("PALLASITE_INT4_TILES", tiles)
        with LLM(tmp_path, **kw) as llm:
            assert llm.engine.params["layers_0"]["attn"]["wqkv"].layout == placed
            outs[placed] = [o.token_ids for o in llm.generate(prompts, sp)]
    assert outs["nk16"] == outs["kn"] == outs["nk_i4"]


@pytest.mark.parametrize("bits,m,kernel", [(4, 512, True), (4, 513, False), (8, 384, False),
                                            (8, 256, True)])
def test_hopper_rows_past_which_the_weight_is_dequantized(monkeypatch, bits, m, kernel):
    """INT4 in the Hopper layout runs its kernel to INT4_HOPPER_MAX_ROWS rows; INT8 to
    INT_MATMUL_MAX_ROWS; past them the weight is dequantized for XLA's dot."""
    from pallasite import kernels
    calls = []
    monkeypatch.setattr(kernels, "_use_pallas", lambda impl, interpret: True)
    monkeypatch.setattr(mg, "int_matmul", lambda x, *a, **kw: calls.append(kw) or x[:, :64])
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 1 << bits, (256, 256))
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
    scale = jnp.full((2, 256), 0.01, jnp.float32)
    kernels.int_matmul(x, mg.pack_t(codes, bits), scale, bits=bits, group_size=128,
                       layout="nk16")
    assert bool(calls) == kernel
    if kernel and m > 256:
        assert calls[0]["consumers"] == 2


@pytest.mark.parametrize("m,k,n,group_size,blocks", [
    (5, 512, 128, 128, dict(block_n=64)),
    (20, 300, 64, 300, dict(block_n=64)),  # one group a column, K padded to the tile
    (3, 1024, 128, 256, dict(block_n=64, num_splits=2)),  # two tiles a group, split-K
    (20, 512, 256, 128, dict(block_n=64, consumers=2)),
])
def test_int4_tiles_match_numpy(m, k, n, group_size, blocks):
    """`unpack="int4"`: the weight as XLA's int4 type, converted a tile at a time."""
    rng = np.random.default_rng(m + k)
    codes, scale, _ = random_weight(rng, k, n, 4, group_size, False)
    _, s, _, g = im.pack_weight(codes, scale, None, bits=4, group_size=group_size)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = x.astype(jnp.bfloat16).astype(np.float32) @ numpy_dequant(codes, scale, None, 4,
                                                                     group_size)
    got = mg.int_matmul(jnp.asarray(x, jnp.bfloat16), mg.pack_i4(codes), s, bits=4,
                        group_size=g, unpack="int4", interpret=True, **blocks)
    err = np.linalg.norm(np.asarray(got, np.float32) - want) / np.linalg.norm(want)
    assert got.shape == (m, n) and err < 1e-2


def test_int4_tiles_refuse_what_they_do_not_take():
    assert mg.supported(4, 512, 128, bits=4, group_size=64, unpack="int4")
    assert mg.supported(4, 512, 128, bits=4, group_size=128, unpack="int4", zero_points=True)
    assert mg.supported(4, 512, 128, bits=8, group_size=128, unpack="int4")
    assert mg.supported(4, 512, 128, bits=4, group_size=128, unpack="int4") is None


def test_int4_tiles_take_an_8_row_mma_up_to_8_rows(monkeypatch):
    """The library's call on int4 tiles: up to 8 rows an 8-row MMA and a deeper ring, the K
    split while the grid stays under eight CTAs an SM; from 9 rows the words' tiles."""
    from pallasite import kernels
    calls = []
    monkeypatch.setattr(kernels, "_use_pallas", lambda impl, interpret: True)
    monkeypatch.setattr(mg, "int_matmul", lambda x, *a, **kw: calls.append(kw) or x[:, :64])
    w = mg.pack_i4(np.zeros((4096, 28672), np.int32))
    scale = jnp.full((32, 28672), 0.01, jnp.float32)
    for m in (1, 8, 9):
        kernels.int_matmul(jnp.zeros((m, 4096), jnp.bfloat16), w, scale, bits=4, group_size=128,
                           layout="nk_i4")
    one, eight, nine = calls
    assert one["unpack"] == "int4" and one["block_m"] == 8 and one["num_stages"] == 4
    assert one["num_splits"] == 4  # 224 column blocks: 896 CTAs
    assert eight == one and "block_m" not in nine and nine["unpack"] == "int4"
