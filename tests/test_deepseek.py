"""DeepSeek-V2/V3 (multi-head latent attention, shared + routed experts with grouped top-k):
tiny random `transformers` checkpoints load and match its logits, generate its greedy tokens
through `LLM`, and the paged cache of latents (absorbed attention) matches the uncached
forward. The MLA decode kernel (interpret mode) matches its `jnp` reference."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from pallasite.model import config_from_dict, forward_logits, init_kv_cache, load_hf
from test_families import assert_greedy_equals_transformers
from test_model import dense_logits, paged_step, rel_err

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=3, first_k_dense_replace=1, max_position_embeddings=512,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.6, "rope_theta": 1e4}
MODELS = {
    # V2-Lite's shape: no q LoRA, greedy routing over a softmax.
    "v2_lite": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
                dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0)),
    "v2_grouped": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
                   dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4,
                        topk_group=2, routed_scaling_factor=16.0, rope_parameters=YARN)),
    "v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
           dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                routed_scaling_factor=2.5, rope_parameters=YARN)),
    "v3_no_interleave": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                         dict(q_lora_rank=24, n_group=2, topk_group=1, norm_topk_prob=False,
                              rope_interleave=False)),
}


def build(name, seed=0):
    config_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**BASE, **extra}))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in pname else p.normal_(0.0, 0.08)
        for layer in model.model.layers:  # a correction bias that changes the choice
            gate = getattr(layer.mlp, "gate", None)
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.normal_(0.0, 0.2)
    return model.eval()


def save(name, folder, seed=0):
    model = build(name, seed)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_match_transformers(name, tmp_path):
    model = save(name, tmp_path)
    config, params = load_hf(tmp_path, dtype=jnp.float32)
    assert config.is_mla and config.num_kv_heads == 1
    ids = np.random.default_rng(1).integers(0, config.vocab_size, (2, 37))
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    assert rel_err(forward_logits(params, config, jnp.asarray(ids)), want) <= 1e-4


@pytest.mark.parametrize("name", ["v3"])
def test_greedy_24_tokens_equal_transformers(name, tmp_path):
    assert_greedy_equals_transformers(save(name, tmp_path), tmp_path)


@pytest.mark.parametrize("name", ["v2_lite", "v3"])
def test_paged_latent_cache_matches_dense(name, tmp_path):
    save(name, tmp_path)
    config, params = load_hf(tmp_path, dtype=jnp.float32)
    page_size, num_pages = 4, 64
    kv = init_kv_cache(config, num_pages, page_size, jnp.float32)
    # The latent and the RoPE key per token, one "kv head": no expanded heads.
    assert [tuple(a.shape) for a in kv[0]] == [(1, num_pages, page_size, config.kv_lora_rank),
                                                (1, num_pages, page_size, config.qk_rope_head_dim)]
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, config.vocab_size, n) for n in (23, 12)]
    dense = [np.asarray(dense_logits(params, config, s[None]))[0] for s in seqs]
    perm = rng.permutation(num_pages)
    page_tables = [perm[:16], perm[16:32]]
    # Prefill seq 0 in chunks of 5, 11 and 4 while seq 1 prefills 9 at once, then decode both.
    plan = [[(0, 0, 5), (1, 0, 9)], [(0, 5, 16)], [(0, 16, 20)]]
    plan += [[(0, t, t + 1), (1, t - 11, t - 10)] for t in range(20, 23)]
    for chunks in plan:
        step = [(s, seqs[s][a:b], a) for s, a, b in chunks]
        logits, kv = paged_step(params, config, kv, step, page_tables, page_size, pad_to=(20, 3))
        for (s, a, b), row in zip(chunks, np.asarray(logits)):
            assert rel_err(row, dense[s][b - 1]) <= 1e-4, (s, b)


# -- the MLA decode kernel (Pallas interpreter) ----------------------------------------------------

def _mla_inputs(rng, B, H, L, R, page_size, pages_per_seq, num_pages, lens):
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    table = rng.permutation(num_pages)[:B * pages_per_seq].reshape(B, pages_per_seq)
    return (f(B, H, L), f(B, H, R), f(1, num_pages, page_size, L), f(1, num_pages, page_size, R),
            jnp.asarray(lens, jnp.int32), jnp.asarray(table, jnp.int32))


def _poison(q_lat, q_pe, lat, rope, lens, table):
    """NaN in every page slot that no row's context reaches."""
    page_size = lat.shape[2]
    live = np.zeros(lat.shape[1:3], bool)
    for row, n in zip(np.asarray(table), np.asarray(lens)):
        k = np.arange(n)
        live[row[k // page_size], k % page_size] = True
    nan = lambda x: jnp.where(jnp.asarray(live)[None, :, :, None], x, jnp.nan)
    return q_lat, q_pe, nan(lat), nan(rope), lens, table


@pytest.mark.parametrize("H,block_h,block_k,v_parts,num_splits", [
    (4, 16, None, 1, 1),  # fewer heads than a block: masked rows; tiles of one page
    (32, 16, 8, 2, 3),    # two head blocks in two column parts, tiles of two pages, 3 splits
    (16, 16, 2, 2, 2),    # tiles of half a page, two column parts
    (16, 16, 32, 1, 1),   # a tile longer than the page table (padded)
])
def test_mla_decode_kernel_matches_reference(H, block_h, block_k, v_parts, num_splits):
    from pallasite.kernels import mla_decode
    rng = np.random.default_rng(H)
    # Lengths: empty (padding row), inside the first page, on a tile edge, the whole table.
    args = _mla_inputs(rng, 4, H, 32, 16, 4, 6, 40, [0, 3, 8, 24])
    want = mla_decode.mla_decode_reference(*args, sm_scale=0.3)
    # Poison every slot past each row's context: the kernel must not let them into its output.
    got = mla_decode.mla_decode(*_poison(*args), sm_scale=0.3, block_h=block_h,
                                block_k=block_k, v_parts=v_parts, num_splits=num_splits,
                                interpret=True)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert not np.asarray(got[0]).any()  # no context: zeros


def test_ragged_mla_kernel_rows_match_reference():
    """A mixed step through `kernels.mla_attention` with the kernel: each token a decode row."""
    from pallasite import kernels
    from pallasite.kernels import mla_decode
    rng = np.random.default_rng(3)
    q_lat, q_pe, lat, rope, _, table = _mla_inputs(rng, 4, 16, 32, 16, 4, 5, 30, [0] * 4)
    # Sequence 0: a 2-token chunk ending at 13; 1: one decode token at 20; then a padding slot.
    query_start, context_lens = jnp.array([0, 2, 3], jnp.int32), jnp.array([13, 20], jnp.int32)
    want = mla_decode.ragged_mla_reference(q_lat, q_pe, lat, rope, query_start, context_lens,
                                           table[:2], sm_scale=0.2)
    got = kernels.mla_attention(q_lat, q_pe, lat, rope, query_start, context_lens, table[:2],
                                sm_scale=0.2, interpret=True, num_splits=2)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert np.asarray(got[:3]).any(axis=(1, 2)).all() and not np.asarray(got[3]).any()


# -- on a mesh: TP over query heads (the latent on every shard), EP over experts ------------------

FAKE_DEVICES = "--xla_force_host_platform_device_count=8"
ON_8_DEVICES = FAKE_DEVICES in os.environ.get("XLA_FLAGS", "")
MESHES = [("v3", (1, 2, 2))]  # TP over query heads and EP over experts at once


@pytest.mark.skipif(ON_8_DEVICES, reason="runs in the parent process")
def test_the_mesh_tests_pass_on_8_fake_devices():
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FAKE_DEVICES}"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           os.path.basename(__file__), "-k", "on_a_mesh"], env=env,
                          capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    report = done.stdout[-8000:] + done.stderr[-2000:]
    assert done.returncode == 0 and f"{len(MESHES)} passed" in report, report


def _flat_batch(chunks, page_tables, page_size, num_tokens):
    """tokens, positions and `Batch` of one ragged step (`test_model.paged_step`'s layout),
    padded to `num_tokens` so that every step shares one compile."""
    from pallasite.model import Batch
    tokens, positions, slots, starts, lens, last = [], [], [], [0], [], []
    for seq, ids, start in chunks:
        pos = np.arange(start, start + len(ids))
        tokens += list(ids)
        positions += list(pos)
        slots += list(page_tables[seq][pos // page_size] * page_size + pos % page_size)
        starts.append(len(tokens))
        lens.append(start + len(ids))
        last.append(len(tokens) - 1)
    pad = num_tokens - len(tokens)
    tokens, positions, slots = tokens + [0] * pad, positions + [0] * pad, slots + [-1] * pad
    table = np.stack([page_tables[seq] for seq, _, _ in chunks])
    i32 = lambda a: jnp.asarray(np.asarray(a, np.int32))
    return i32(tokens), i32(positions), Batch(*(i32(a) for a in (starts, lens, table, slots,
                                                                 last)))


@pytest.mark.skipif(not ON_8_DEVICES, reason="runs in the 8-device child process")
@pytest.mark.parametrize("name,shape", MESHES, ids=[f"{n}-{s}" for n, s in MESHES])
def test_on_a_mesh_equals_one_device(name, shape, tmp_path):
    from jax.sharding import PartitionSpec as P
    from pallasite.model import forward
    from pallasite.sharding import Layout, MeshPlan, make_mesh, param_shardings
    save(name, tmp_path)
    config, params = load_hf(tmp_path, dtype=jnp.float32)
    layout = Layout(config, make_mesh(MeshPlan(*shape)))
    _, on_mesh = load_hf(tmp_path, dtype=jnp.float32,
                         shardings=param_shardings(config, layout.mesh))
    attn, moe = on_mesh["layers_1"]["attn"], on_mesh["layers_1"]["moe"]
    assert attn["w_uk"].sharding.spec == P(None, "tensor", None)
    assert attn["wkv_a"].sharding.spec == P(None, None)  # the latent's projection: whole
    assert moe["w_up"].sharding.spec == P("expert", None, "tensor")
    ids = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 19)))
    want = dense_logits(params, config, ids)
    assert rel_err(layout.forward_logits()(on_mesh, ids), want) <= 1e-5
    page_size, num_pages = 4, 16
    kv = layout.init_kv_cache(num_pages, page_size, jnp.float32)
    one_kv = init_kv_cache(config, num_pages, page_size, jnp.float32)
    assert kv[0][0].shape == (layout.plan.tensor, num_pages, page_size, config.kv_lora_rank)
    tables = [np.arange(8), np.arange(8, 16)]
    seqs = np.asarray(ids)
    plan = [[(0, 0, 7), (1, 0, 3)], [(0, 7, 8), (1, 3, 9)], [(0, 8, 9), (1, 9, 10)]]
    step, one_device = layout.forward(), jax.jit(forward, static_argnums=1)  # not op by op
    for chunks in plan:
        args = _flat_batch([(s, seqs[s][a:b], a) for s, a, b in chunks], tables, page_size, 10)
        got, kv = step(on_mesh, *args[:2], kv, args[2])
        ref, one_kv = one_device(params, config, *args[:2], one_kv, args[2])
        assert rel_err(got, ref) <= 1e-5


# -- the plan explorer ---------------------------------------------------------------------------

DEEPSEEK_V3 = dict(  # its config.json's shapes (no plan preset: bf16 exceeds 8 x H100)
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4,
    routed_scaling_factor=2.5, max_position_embeddings=163840,
    rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096})


def test_plan_prices_the_latent_cache_and_absorbed_attention():
    from pallasite.sharding import MeshPlan
    from pallasite.tools.plan import model as pm
    v3 = config_from_dict(DEEPSEEK_V3)
    assert v3.is_mla and v3.sm_scale == pytest.approx(192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)
    # Latent + RoPE key, bf16, 61 layers; every tensor shard keeps the whole latent.
    for plan in (MeshPlan(), MeshPlan(1, 8, 1)):
        assert pm.kv_bytes_per_token(v3, plan, 2) == 61 * (512 + 64) * 2
    assert pm.attn_flops_per_pair(v3) == 2 * (2 * 512 + 64)
    shapes = pm.shapes_of(v3, MeshPlan(1, 1, 8))
    routed = 58 * 256 * 3 * 7168 * 2048  # 58 MoE layers of 256 experts
    assert shapes.glob["experts"] == routed  # the shared experts count as dense
    assert shapes.device["experts"] == routed // 8
