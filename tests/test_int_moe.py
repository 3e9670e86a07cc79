"""INT4/INT8 weight-only MoE experts through the grouped path: the grouped integer kernel in
Pallas interpret mode against its jnp reference and a numpy dequantization (odd row counts,
empty experts, rows past the groups, group sizes 32/64/128 and per channel, zero points, act
order, 4 and 8 bits); `quantize_params` on an MoE model; Mixtral- and Qwen3-MoE-shaped AWQ,
GPTQ and compressed-tensors checkpoints whose experts are stored one module an expert, loaded
and compared with their numpy-dequantized float twins; an engine generating greedy tokens from
one; and the errors a broken expert tensor gives."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hf_models
import int_fixtures
from int_fixtures import compressed_linear, ct_config, gptq_linear
from pallasite import kernels
from pallasite.kernels import grouped_int as gi
from pallasite.kernels.reference import grouped_mlp_reference
from pallasite.model import config_from_dict, forward_logits, init_params, load_hf, quant
from pallasite.model import quant_int
from pallasite.model.errors import CheckpointError
from pallasite.model.int_formats import IntLinear
from pallasite.model.quant_int import PackedInt, describe
from pallasite.serving.llm import LLM, SamplingParams


def random_sizes(rng, m, experts, total):
    cuts = np.sort(rng.integers(0, total + 1, experts - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)
    sizes[0] += sizes[1]
    sizes[1] = 0  # always one empty expert
    return sizes


def random_experts(rng, e, k, n, bits, group, asym, perm):
    """Packed experts and their f32 [E, K, N] weights in input order (numpy)."""
    g = k if group == -1 else group
    groups = -(-k // g)
    codes = [rng.integers(0, 2 ** bits, (k, n)) for _ in range(e)]
    scales = [rng.uniform(0.5, 1.5, (groups, n)).astype(np.float32) / 2 ** bits
              for _ in range(e)]
    zeros = [rng.integers(0, 2 ** bits, (groups, n)).astype(np.float32) if asym else None
             for _ in range(e)]
    words, scale, zero, gs = gi.pack_experts(codes, scales, zeros, bits=bits, group_size=g)
    rows = np.arange(k) // g
    w = np.stack([(c - (2 ** (bits - 1) if z is None else z[rows])) * s[rows]
                  for c, s, z in zip(codes, scales, zeros)])
    order = None
    if perm:
        order = np.stack([rng.permutation(k) for _ in range(e)])
        w = np.stack([we[np.argsort(o)] for we, o in zip(w, order)])  # stored row i = input perm[i]
        order = jnp.asarray(order, jnp.int32)
    return gi.IntExperts(words, scale, zero, order, bits, gs), w


def numpy_grouped(x, sizes, w):
    out, start = np.zeros((x.shape[0], w.shape[-1]), np.float32), 0
    for e, size in enumerate(sizes):
        out[start:start + size] = x[start:start + size] @ w[e]
        start += size
    return out


@pytest.mark.parametrize("m,e,k,n,bits,group,asym,perm,dtype,block_m,extra", [
    (37, 4, 320, 64, 4, 64, True, True, jnp.float32, 16, {}),  # act order; K padded
    (21, 5, 256, 128, 4, 32, False, False, jnp.bfloat16, 16, {}),
    (50, 3, 256, 64, 4, 128, True, False, jnp.float32, 64, {}),
    (19, 4, 192, 32, 8, -1, False, False, jnp.float32, 16, {}),  # per channel
    (33, 6, 384, 64, 8, 64, True, True, jnp.bfloat16, 16, {}),
    (9, 3, 1280, 32, 4, 128, True, False, jnp.float32, 16, dict(num_splits=3)),  # 5 K tiles
    (40, 3, 768, 64, 4, 384, True, False, jnp.bfloat16, 16, dict(num_splits=2)),  # bf16 128 + c
    (26, 4, 512, 64, 4, 128, True, False, jnp.bfloat16, 16, dict(per_group=False)),
    (3, 6, 768, 64, 4, 384, True, False, jnp.bfloat16, 1, dict(num_splits=2)),  # FMA rows
    (7, 3, 256, 64, 8, 64, True, True, jnp.float32, 4, {}),
    (4, 8, 320, 32, 4, -1, False, False, jnp.bfloat16, 2, {}),  # FMA rows, per channel
])
def test_kernel_equals_reference_and_numpy(m, e, k, n, bits, group, asym, perm, dtype, block_m,
                                           extra):
    rng = np.random.default_rng(m + k + bits)
    w, dense = random_experts(rng, e, k, n, bits, group, asym, perm)
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    sizes = random_sizes(rng, m, e, m - 3)  # three rows past the groups: zeros
    want = numpy_grouped(np.asarray(x, np.float32), sizes, dense)
    ref = gi.grouped_int_matmul_reference(x, jnp.asarray(sizes), w)
    got = gi.grouped_int_matmul(x, jnp.asarray(sizes), w, block_m=block_m, interpret=True,
                                **extra)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = (1e-5 if dtype == jnp.float32 else 1e-2) * np.abs(want).max()
    np.testing.assert_allclose(np.asarray(ref, np.float32), want, atol=tol)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=tol)
    assert not np.asarray(got[m - 3:]).any()


def test_grouped_mlp_with_packed_experts_glu_biases_and_a_plain_weight():
    rng = np.random.default_rng(5)
    m, e, d, f = 29, 4, 128, 64
    wg, dg = random_experts(rng, e, d, f, 4, 32, True, True)
    wu, du = random_experts(rng, e, d, f, 8, 64, False, False)
    wd, dd = random_experts(rng, e, f, d, 4, -1, True, False)
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    sizes = jnp.asarray(random_sizes(rng, m, e, m))
    as_jnp = lambda a: jnp.asarray(a, jnp.float32)
    want = grouped_mlp_reference(x, sizes, as_jnp(dg), as_jnp(du), as_jnp(dd))
    for got in (kernels.grouped_mlp(x, sizes, wg, wu, wd, interpret=True),
                kernels.grouped_mlp(x, sizes, wg, wu, wd)):  # the CPU reference
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # GPT-OSS's clamped GLU with per-expert biases; the down projection a plain array
    glu = lambda g, u: jnp.minimum(g, 0.5) * jax.nn.sigmoid(g) * (u + 1)
    biases = tuple(as_jnp(rng.normal(size=s)) for s in ((e, f), (e, f), (e, d)))
    want = grouped_mlp_reference(x, sizes, as_jnp(dg), as_jnp(du), as_jnp(dd), glu=glu,
                                 biases=biases)
    got = kernels.grouped_mlp(x, sizes, wg, wu, as_jnp(dd), glu=glu, biases=biases,
                              interpret=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_pack_experts_fills_missing_zeros_and_permutations():
    rng = np.random.default_rng(2)
    k, n = 64, 32
    lins = [IntLinear(rng.integers(0, 16, (k, n)).astype(np.uint8),
                      rng.uniform(0.01, 0.02, (2, n)).astype(np.float32), None, 4, 32),
            IntLinear(rng.integers(0, 16, (k, n)).astype(np.uint8),
                      rng.uniform(0.01, 0.02, (2, n)).astype(np.float32),
                      rng.integers(0, 16, (2, n)).astype(np.float32), 4, 32,
                      rng.permutation(k))]
    packed = quant_int.pack_experts(lins, (2, k, n), 1)
    assert packed.lead == 1 and packed.zero.shape[0] == 2 and packed.perm.shape == (2, k)
    for got, lin in zip(packed.dequantize(), lins):
        np.testing.assert_allclose(got, lin.dequantize(), rtol=1e-6)
    bad = IntLinear(lins[0].codes, lins[0].scale, None, 8, 32)
    with pytest.raises(ValueError, match="expert 1 has 8 bits"):
        quant_int.pack_experts([lins[0], bad], (2, k, n), 1)


# -- quantize-on-load / quantize_params ---------------------------------------------------------
def dequantized(params):
    return jax.tree.map(lambda w: w.dequantize() if isinstance(w, PackedInt) else w, params,
                        is_leaf=lambda w: isinstance(w, PackedInt))


@pytest.mark.parametrize("mode", ["w4a16", "w8a16"])
def test_quantize_params_packs_the_experts(mode):
    config = config_from_dict(dict(
        model_type="qwen3_moe", vocab_size=128, hidden_size=128, intermediate_size=96,
        moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        tie_word_embeddings=False))
    # Under jit: eagerly the init pass and each forward compile op by op.
    params = jax.jit(init_params, static_argnums=(0, 1))(config, 3)
    forward = jax.jit(forward_logits, static_argnums=1)
    qp = quant_int.quantize_params(params, mode)
    moe = qp["layers_1"]["moe"]
    for name, shape in (("w_gate", (4, 128, 64)), ("w_up", (4, 128, 64)),
                        ("w_down", (4, 64, 128))):
        w = moe[name]
        assert isinstance(w, PackedInt) and w.lead == 1 and w.shape == shape
        assert w.words.shape[0] == 4 and w.bits == (4 if mode == "w4a16" else 8)
    assert moe["w_gate"].group_size >= 128  # a group of 128 covers K = 128: one a channel
    assert not isinstance(moe["router"], PackedInt) and quant.all_linear_quantized(qp)
    assert describe(qp) == f"{mode} channel"
    ids = np.random.default_rng(0).integers(0, 128, (2, 12))
    got = forward(qp, config, ids)
    np.testing.assert_allclose(got, forward(dequantized(qp), config, ids), rtol=1e-5,
                               atol=1e-5)
    plain = forward(params, config, ids)
    err = np.linalg.norm(got - plain) / np.linalg.norm(plain)
    assert err < (0.3 if mode == "w4a16" else 0.02)  # RTN of random weights, per channel


# -- checkpoints ---------------------------------------------------------------------------------
ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
ROUTERS = ["lm_head", r"re:.*block_sparse_moe\.gate$", r"re:.*mlp\.gate$"]
FORMATS = {
    **int_fixtures.GROUP32,
    "gptq8": (lambda rng, p, k, n: gptq_linear(rng, p, k, n, -1, bits=8, sym=False),
              {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False,
               "sym": False}),
    "compressed": (lambda rng, p, k, n: compressed_linear(rng, p, k, n, 32, sym=False),
                   ct_config(g=32, sym=False, ignore=ROUTERS)),
    "compressed_actorder": (
        lambda rng, p, k, n: compressed_linear(rng, p, k, n, 32, act_order=True),
        ct_config(g=32, ignore=ROUTERS, actorder="group")),
}
FAMILIES = {"mixtral": {}, "qwen3_moe": dict(moe_intermediate_size=64)}


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory):
    out = {}
    for family, extra in FAMILIES.items():
        folder = tmp_path_factory.mktemp(family)
        hf_models.save(family, folder, config=extra)
        out[family] = folder
    return out


def write_pair(float_dir, root, fmt, seed=0):
    """(quantized folder, its float twin) with the attention projections and every expert
    stored in `fmt`, one module an expert."""
    return int_fixtures.write_pair(float_dir, root, fmt, FORMATS, lambda module: (
        module.endswith(ATTN) or ".experts." in module), seed)


TOKENS = jnp.asarray([[3, 17, 5, 99, 42, 7, 1, 120, 64, 8, 33]])


@pytest.mark.parametrize("family,fmt", [("mixtral", "awq"), ("mixtral", "gptq"),
                                        ("qwen3_moe", "compressed"), ("qwen3_moe", "gptq8")])
def test_checkpoint_experts_equal_the_dequantized_twin(float_dirs, tmp_path, family, fmt):
    qdir, twin = write_pair(float_dirs[family], tmp_path, fmt)
    config, params = load_hf(qdir, dtype=jnp.float32)
    _, twin_params = load_hf(twin, dtype=jnp.float32)
    w_up = params["layers_1"]["moe"]["w_up"]
    assert isinstance(w_up, PackedInt) and w_up.lead == 1
    assert w_up.shape == twin_params["layers_1"]["moe"]["w_up"].shape
    assert (w_up.perm is not None) == (fmt == "gptq") and (w_up.zero is None) == (fmt == "gptq")
    for name in ("w_gate", "w_up", "w_down"):  # the stacked experts are the twin's weights
        np.testing.assert_allclose(params["layers_0"]["moe"][name].dequantize(),
                                   twin_params["layers_0"]["moe"][name], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(forward_logits(params, config, TOKENS),
                               forward_logits(twin_params, config, TOKENS), rtol=1e-4,
                               atol=1e-4)
    if fmt == "gptq":  # the loaded experts through the kernel (interpret mode), act order
        moe = params["layers_0"]["moe"]
        ws = [quant.grouped_operand(moe[n]) for n in ("w_gate", "w_up", "w_down")]
        x = jax.random.normal(jax.random.key(0), (21, config.hidden_size))
        sizes = jnp.asarray([9, 0, 7, 5], jnp.int32)
        want = grouped_mlp_reference(x, sizes, *(twin_params["layers_0"]["moe"][n]
                                                 for n in ("w_gate", "w_up", "w_down")))
        np.testing.assert_allclose(kernels.grouped_mlp(x, sizes, *ws, interpret=True), want,
                                   rtol=1e-4, atol=1e-4 * np.abs(want).max())


def twin_greedy(folder, prompt, n):
    """Greedy continuation by the float twin's full forward, padded to one shape."""
    config, params = load_hf(folder, dtype=jnp.float32)
    step = jax.jit(lambda p, x: forward_logits(p, config, x))
    ids = list(prompt)
    for _ in range(n):
        padded = jnp.asarray([ids + [0] * (32 - len(ids))])
        ids.append(int(jnp.argmax(step(params, padded)[0, len(ids) - 1])))
    return ids[len(prompt):]


def test_engine_generates_the_twins_tokens_from_int4_experts(float_dirs, tmp_path):
    qdir, twin = write_pair(float_dirs["mixtral"], tmp_path, "compressed_actorder")
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [5, 17, 33, 2, 9, 100, 21]
    with LLM(qdir, dtype=jnp.float32, max_model_len=64, num_pages=32, page_size=8,
             max_num_seqs=2, max_num_batched_tokens=16, token_buckets=[16],
             page_buckets=[8], warmup=False) as llm:  # compiles only the greedy steps' programs
        w_down = llm.engine.params["layers_1"]["moe"]["w_down"]
        assert isinstance(w_down, PackedInt) and w_down.bits == 4 and w_down.perm is not None
        got = llm.generate([prompt], sp)[0].token_ids
    assert list(got) == twin_greedy(twin, prompt, 8)


def test_quantize_on_load_packs_the_experts(float_dirs):
    _, params = load_hf(float_dirs["mixtral"], dtype=jnp.float32, quantization="w4a16")
    w = params["layers_0"]["moe"]["w_down"]
    assert isinstance(w, PackedInt) and w.lead == 1 and w.shape == (4, 96, 64)
    assert w.group_size == 256  # 128 does not divide K = 96: one scale a channel


def test_broken_expert_tensors_are_named(float_dirs, tmp_path):
    qdir, _ = write_pair(float_dirs["mixtral"], tmp_path, "awq")
    tensors = load_file(qdir / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.2.w3.scales"
    good = tensors[name]
    tensors[name] = good[:1]  # one group of scales where there are two
    save_file(tensors, qdir / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"tensor {name} has shape \(1, 96\); "
                                              r"expected \(2, 96\)"):
        load_hf(qdir, dtype=jnp.float32)
    # one expert left in floating point while its siblings are quantized
    tensors[name] = good
    module = "model.layers.0.block_sparse_moe.experts.1.w2"
    for suffix in ("qweight", "qzeros", "scales"):
        del tensors[f"{module}.{suffix}"]
    tensors[module + ".weight"] = np.zeros((64, 96), np.float32)
    save_file(tensors, qdir / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"{module} is stored in floating point"):
        load_hf(qdir, dtype=jnp.float32)


def test_gpt_oss_experts_quantize_on_load(tmp_path):
    """GPT-OSS's experts (clamped GLU, per-expert biases) packed on load run as their
    dequantized twin does, and near the float model: the experts' INT8 weights are 0.6% off,
    which this tiny model's routing and clamp turn into about 7% of its logits (the dense
    linears alone: 1%)."""
    hf_models.save("gpt_oss", tmp_path)
    config, fp = load_hf(tmp_path, dtype=jnp.float32)
    _, qp = load_hf(tmp_path, dtype=jnp.float32, quantization="w8a16")
    moe = next(lp["moe"] for name, lp in qp.items() if name.startswith("layers_"))
    assert all(isinstance(moe[n], PackedInt) and moe[n].lead == 1
               for n in ("w_gate", "w_up", "w_down"))
    ids = np.random.default_rng(1).integers(0, config.vocab_size, (1, 12))
    got = forward_logits(qp, config, ids)
    np.testing.assert_allclose(got, forward_logits(dequantized(qp), config, ids), rtol=1e-4,
                               atol=1e-4)
    want = forward_logits(fp, config, ids)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.12
