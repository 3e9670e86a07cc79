"""The sharding-plan explorer: shard shapes against real sharded arrays, hand-computed memory,
KV and communication figures, rejected plans, the JSON schema, the CLI on every preset."""

import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import pytest

from pallasite.model import config_from_dict, param_shapes
from pallasite.sharding import MeshPlan
from pallasite.tools.plan import cli as plan, inputs as pi, model as pm, search as psearch

TINY_MOE = dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128,
                moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16)
TINY_DENSE = dict(model_type="llama", vocab_size=250, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
PLANS = ["1x4x1", "2x4x1", "1x2x2", "2x1x4"]


def run_on_fake_devices(script: str, devices: int):
    """Run `script` in a child process with `devices` fake CPU devices; its last stdout line
    is JSON, returned parsed."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_shard_shapes_match_real_sharded_arrays():
    """Place real params on 8 fake CPU devices under each plan; every shard's shape must be the
    one the tool computes (kv heads copied at tp=4 > 2 kv heads, odd vocabulary replicated)."""
    script = textwrap.dedent(f"""
        import json, jax, jax.numpy as jnp
        from pallasite.model import config_from_dict, param_shapes
        from pallasite.sharding import Layout, MeshPlan, make_mesh
        out = {{}}
        for name, raw in (("moe", {TINY_MOE!r}), ("dense", {TINY_DENSE!r})):
            config = config_from_dict(raw)
            # Zeros of the real shapes (values do not change shard shapes; eager init is slow).
            host = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.bfloat16), param_shapes(config))
            for text in {PLANS!r}:
                plan = MeshPlan.parse(text)
                if plan.expert > 1 and not config.is_moe:
                    continue
                layout = Layout(config, make_mesh(plan))
                params = layout.place_params(host)
                flat = jax.tree_util.tree_flatten_with_path(params)[0]
                out[name + text] = {{jax.tree_util.keystr(k): [list(s.data.shape)
                                    for s in v.addressable_shards] for k, v in flat}}
        print(json.dumps(out))
    """)
    real = run_on_fake_devices(script, 8)
    checked = 0
    for key, shards in real.items():
        name, text = key[:-5], key[-5:]
        config = config_from_dict(TINY_MOE if name == "moe" else TINY_DENSE)
        for row in pm.param_table(config, MeshPlan.parse(text)):
            assert all(tuple(s) == row["shard"] for s in shards[row["name"]]), (key, row)
            checked += 1
    assert checked > 100


def test_weights_on_one_device_are_the_eval_shape_bytes():
    config = pi.load_model("llama-3-8b")
    leaves = jax.tree.leaves(param_shapes(config))
    total = sum(math.prod(x.shape) for x in leaves)
    shapes = pm.shapes_of(config, MeshPlan())
    assert shapes.total == shapes.device_total == total == 8_030_261_248
    mem = pm.memory(config, shapes, MeshPlan(), pi.Cluster(pi.GPUS["h100"]), pi.Workload())
    assert mem.weights == 2 * total  # 16.06 GB in bf16
    assert round(mem.weights / 1e9, 2) == 16.06
    kv = mem.kv_tokens * mem.kv_per_token
    assert mem.weights + mem.workspace + kv + mem.headroom == pytest.approx(mem.budget)
    assert mem.headroom >= 0


def test_tensor_split_halves_the_split_weights_only():
    config = pi.load_model("llama-3-8b")
    one, two = pm.shapes_of(config, MeshPlan()), pm.shapes_of(config, MeshPlan(1, 2, 1))
    norms = 2 * config.num_layers * config.hidden_size + config.hidden_size  # replicated
    assert two.device_total == (one.total - norms) // 2 + norms


@pytest.mark.parametrize("name,count", [("llama-3-8b", 8_030_261_248),
                                        ("llama-3-70b", 70_553_706_496),
                                        ("qwen3-32b", 32_762_123_264),
                                        ("mixtral-8x7b", 46_702_792_704),
                                        ("qwen3-30b-a3b", 30_532_122_624)])
def test_preset_parameter_counts(name, count):
    """The published parameter counts of the checkpoints (llama-3-8b is also checked against
    `param_shapes` directly above)."""
    assert pm.shapes_of(pi.load_model(name), MeshPlan()).total == count


def test_kv_bytes_per_token():
    llama = pi.load_model("llama-3-8b")
    assert pm.kv_bytes_per_token(llama, MeshPlan(), 2) == 2 * 32 * 8 * 128 * 2
    assert pm.kv_bytes_per_token(llama, MeshPlan(1, 2, 1), 2) == 2 * 32 * 4 * 128 * 2
    qwen = pi.load_model("qwen3-30b-a3b")  # 4 kv heads on 8 shards: one copied head each
    assert pm.kv_bytes_per_token(qwen, MeshPlan(1, 8, 1), 2) == 2 * 48 * 1 * 128 * 2


def test_all_reduce_volume():
    llama = pi.load_model("llama-3-8b")
    cluster = pi.Cluster(pi.GPUS["h100"])
    comm = pm.collectives(llama, MeshPlan(1, 2, 1), cluster, tokens=1, act_bytes=2)
    # Two ring all-reduces of 4096 bf16 values: each device sends 2(t-1)/t of 8192 B per one.
    assert comm["all-reduce x2"][0] == 2 * 8192
    comm8 = pm.collectives(llama, MeshPlan(1, 8, 1), cluster, tokens=1, act_bytes=2)
    assert comm8["all-reduce x2"][0] == 2 * 2 * 7 / 8 * 8192
    assert comm8["all-reduce x2"][1] > comm["all-reduce x2"][1]
    assert pm.collectives(llama, MeshPlan(), cluster, 1, 2) == {}


def test_invalid_plans_rejected_with_reasons():
    llama = pi.load_model("llama-3-8b")
    cluster = pi.Cluster(pi.GPUS["h100"], gpus_per_host=6)
    by_plan = {r["plan"]: r for r in psearch.explore(llama, cluster, pi.Workload())}
    assert by_plan["dp=1,tp=6,ep=1"]["status"] == "invalid"
    assert "does not divide num_heads=32" in by_plan["dp=1,tp=6,ep=1"]["reason"]
    assert "mixture-of-experts" in by_plan["dp=3,tp=1,ep=2"]["reason"]
    assert by_plan["dp=3,tp=2,ep=1"]["status"] == "ok"


def test_plan_that_cannot_fit_says_by_how_much():
    config = pi.load_model("llama-3-70b")
    cluster = pi.Cluster(pi.GPUS["h100"])
    wl = pi.Workload()
    rec = psearch.evaluate(config, MeshPlan(8, 1, 1), cluster, wl)
    assert rec["status"] == "no-fit"
    budget = pi.GPUS["h100"].memory_gib * pi.const("mem_fraction")
    weights = 70_553_706_496 * 2 / pi.GIB
    assert rec["short_gib"] > weights - budget
    assert rec["short_gib"] < weights - budget + 2  # + workspace and one sequence's KV
    assert f"{rec['short_gib']:.2f} GiB short" in rec["reason"]
    assert psearch.evaluate(config, MeshPlan(2, 4, 1), cluster, wl)["status"] == "ok"


def test_decode_is_memory_bound_and_prefill_compute_bound():
    config = pi.load_model("llama-3-8b")
    plan_, cluster, wl = MeshPlan(), pi.Cluster(pi.GPUS["h100"]), pi.Workload()
    shapes = pm.shapes_of(config, plan_)
    d1 = pm.decode_step(config, shapes, plan_, cluster, wl, 1, 1024)
    assert d1.bound == "memory"
    # Batch-1 decode reads the weights once (less the embedding table): the roofline floor.
    floor = (shapes.total - config.vocab_size * config.hidden_size) * 2 / 3.0e12
    assert floor < d1.time < 1.6 * floor
    assert pm.prefill_step(config, shapes, plan_, cluster, wl, 4, 1024).bound == "compute"


SCHEMA_TOP = {"schema", "model", "params", "gpu", "gpus_per_host", "hosts", "workload",
              "constants", "plans"}
SCHEMA_OK = {"plan", "data", "tensor", "expert", "status", "memory_gib", "params_total",
             "params_per_gpu", "prefill", "ttft_ms", "prefill_ms_per_token_loaded",
             "decode_batch1", "compute_bound_batch", "compute_bound_batch_weights_only",
             "max_batch", "curve", "best", "sla_ok", "rate_ok", "max_tok_s"}


def test_json_schema(tmp_path):
    path = tmp_path / "plans.json"
    assert plan.main(["qwen3-30b-a3b", "--gpus-per-host", "4", "--tpot-ms", "40",
                      "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    assert set(out) == SCHEMA_TOP and out["schema"] == 1
    ok = [r for r in out["plans"] if r["status"] == "ok"]
    assert ok and all(set(r) == SCHEMA_OK for r in ok)
    assert {"dp=1,tp=1,ep=4", "dp=1,tp=4,ep=1", "dp=4,tp=1,ep=1"} <= {r["plan"] for r in ok}
    assert set(ok[0]["memory_gib"]) >= {"weights", "workspace", "kv_gib", "kv_tokens",
                                        "kv_seqs", "headroom", "budget"}
    assert set(ok[0]["curve"][0]) == {"batch", "decode_ms", "tpot_ms", "tok_s", "bound"}
    ep = next(r for r in ok if r["plan"] == "dp=1,tp=1,ep=4")
    assert "all-to-all x2" in ep["decode_batch1"]["comm_per_layer"]
    assert all(r["best"]["tpot_ms"] <= 40 for r in ok if r["best"])


@pytest.mark.parametrize("name", sorted(pi.PRESETS))
def test_cli_runs_for_each_preset(name, capsys):
    assert plan.main([name, "--prompt", "512:2048", "--output", "128:512", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert f"{name} on 8 x H100" in out and "dp=" in out


def test_png_written(tmp_path):
    png = tmp_path / "plans.png"
    assert plan.main(["mixtral-8x7b", "--tpot-ms", "30", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_config_json_path_and_bad_input(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TINY_DENSE))
    assert plan.main([str(tmp_path), "--gpus-per-host", "2"]) == 0
    assert plan.main(["no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_moe_experts_cost_follows_the_code_path():
    """Below kernels.GROUPED_MIN_ROWS_PER_EXPERT rows per expert the step reads every expert
    (XLA's dense ragged_dot); above it only the routed ones, at least one expert per row."""
    from pallasite.kernels import GROUPED_MIN_ROWS_PER_EXPERT
    config = pi.load_model("qwen3-30b-a3b", 2)
    plan_ = MeshPlan(1, 1, 1)
    shapes, wl = pm.shapes_of(config, plan_), pi.Workload()
    cluster = pi.Cluster(pi.GPUS["h100"], gpus_per_host=8)
    experts = shapes.device["experts"] * wl.weight_bytes
    few = pm.decode_step(config, shapes, plan_, cluster, wl, 1, 1024)
    rest = few.hbm_bytes - experts
    assert rest > 0 and few.t_experts > experts / (cluster.gpu.hbm_tbps * 1e12)
    k, E = config.num_experts_per_tok, config.num_experts
    many_tokens = GROUPED_MIN_ROWS_PER_EXPERT * E // k
    many = pm.prefill_step(config, shapes, plan_, cluster, wl, 1, many_tokens)
    # grouped path: each row meets one expert, so expert FLOPs are k/E of the dense product's
    dense_flops = 2 * many_tokens * k * shapes.device["experts"]
    assert many.mm_flops < dense_flops / 4


# -- the step's memory and the validation harness ---------------------------------------------
def test_activation_parts_by_hand():
    """Llama-3-8B, a prefill of 4 prompts of 1024 tokens, bf16: the buffers the step makes."""
    llama = pi.load_model("llama-3-8b")
    T, S = 4096, 4
    parts = pm.activation_parts(llama, MeshPlan(), T, S, context=1024)
    assert parts["stream"] == 3 * T * 4096 * 2
    assert parts["attention"] == T * (2 * 32 + 2 * 8) * 128 * 2  # one split: no partials
    assert parts["mlp"] == 2 * T * 14336 * 2
    assert parts["logits"] == S * 128256 * (2 + 4 + 4)
    assert parts["workspace"] == 32 * 2 ** 20
    total = parts["stream"] + parts["mlp"] + parts["logits"] + parts["workspace"]
    assert pm.activation_bytes(llama, MeshPlan(), T, S, 1024) == total
    # tp=2 halves the heads, the MLP units and the vocabulary, not the residual stream
    half = pm.activation_parts(llama, MeshPlan(1, 2, 1), T, S, context=1024)
    assert half["stream"] == parts["stream"]
    assert (half["attention"], half["mlp"]) == (parts["attention"] / 2, parts["mlp"] / 2)
    assert half["logits"] == parts["logits"] / 2


def test_attention_splits_follow_the_kernel_rule():
    """kernels.ragged_paged_attention with the H100 tiles (block_rows 64, 64 keys = 4 pages a
    tile, 264 programs wanted, at most 16 splits): batch-1 decode over 65 pages has 1 block x 8
    kv heads and 17 key tiles, so it wants 33 splits and takes the cap, 16; batch 64 or a
    1024-token prefill fill the GPU unsplit."""
    llama = pi.load_model("llama-3-8b")
    assert pm.attention_splits(llama, MeshPlan(), 1, 1, 1025, 16) == 16
    assert pm.attention_splits(llama, MeshPlan(), 64, 64, 1025, 16) == 1
    assert pm.attention_splits(llama, MeshPlan(), 1024, 1, 1024, 16) == 1
    parts = pm.activation_parts(llama, MeshPlan(), 1, 1, context=1025)
    assert parts["attention"] == (2 * 32 + 2 * 8) * 128 * 2 + 16 * 32 * 129 * 4


def test_expert_rows_choose_the_code_path():
    """Qwen3-30B-A3B (128 experts, top 8): the grouped kernel from 16 rows per local expert.
    With ep=2 the receive buffer holds both shards' rows for 64 local experts, so 128 tokens
    take the kernel there but XLA's ragged_dot on one device."""
    qwen = pi.load_model("qwen3-30b-a3b", 2)
    assert pm.expert_rows(qwen, MeshPlan(), 32) == (256, False)
    assert pm.expert_rows(qwen, MeshPlan(), 1024) == (8192, True)
    assert pm.expert_rows(qwen, MeshPlan(), 128) == (1024, False)
    assert pm.expert_rows(qwen, MeshPlan(1, 1, 2), 128) == (1024, True)
    assert pm.expert_rows(qwen, MeshPlan(1, 4, 1), 1024)[1] is False  # 768 / 4 = 192 columns
    # ragged_dot path: the rows, and the rows masked for every expert with their product
    mlp = pm.activation_parts(qwen, MeshPlan(), 32, 32, 1025)["mlp"]
    assert mlp == (2 * 256 * 2048 + 128 * 256 * (2048 + 768)) * 2
    # kernel path: rows padded to 64-row blocks per expert, with their gate and up products
    padded = -(-(8192 + 128 * 63) // 64) * 64
    mlp = pm.activation_parts(qwen, MeshPlan(), 1024, 1, 1024)["mlp"]
    assert mlp == (2 * 8192 * 2048 + padded * (2048 + 2 * 768)) * 2


def test_activation_estimate_follows_xla_on_cpu():
    """XLA's own size of the compiled paged step on CPU (float32, so no dtype copies; context
    small so the CPU attention reference stays small) against the estimate: the residual
    stream, the MLP's intermediates and the logits (on CPU the product is already the f32
    logits, and one program holds no previous step's)."""
    import numpy as np
    import jax.numpy as jnp
    from pallasite.model import forward
    from pallasite.model.transformer import kv_cache_shape
    from pallasite.tools.plan.measure import make_batch

    def xla_bytes(config, tokens):
        tok, pos, batch, pages = make_batch("decode", tokens, 15, config.vocab_size,
                                            np.random.default_rng(0))
        spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
        page = jax.ShapeDtypeStruct(kv_cache_shape(config, pages + 1, 16), jnp.float32)
        step = jax.jit(lambda p, t, q, kv, b: forward(p, config, t, q, kv, b), donate_argnums=3)
        m = step.lower(param_shapes(config), spec(tok), spec(pos),
                       [(page, page)] * config.num_layers,
                       type(batch)(*map(spec, batch))).compile().memory_analysis()
        return m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes

    sizes = {}
    for width, tokens in ((8192, 64), (16384, 64), (24576, 64), (16384, 128)):
        config = config_from_dict(dict(TINY_DENSE, vocab_size=8192, hidden_size=256,
                                       intermediate_size=width, num_attention_heads=4))
        p = pm.activation_parts(config, MeshPlan(), tokens, tokens, 16, act_bytes=4)
        mlp_phase = p["stream"] + max(p["attention"], p["mlp"])
        estimate = mlp_phase + tokens * 8192 * 4
        sizes[width, tokens] = xla_bytes(config, tokens)
        # XLA packs the logits into buffers the MLP freed when it can: between the two
        assert 0.97 * mlp_phase <= sizes[width, tokens] <= 1.01 * estimate
    # the MLP term's slope is exact (2 x tokens x width x 4 bytes), and it grows with tokens
    assert sizes[24576, 64] - sizes[16384, 64] == 2 * 64 * 8192 * 4
    assert sizes[16384, 128] == pytest.approx(2 * sizes[16384, 64], rel=1e-3)


def test_embedding_lookup_adds_one_all_reduce_per_step():
    """The vocab-parallel embedding sums its shards' rows once per step, beside the two
    all-reduces of each layer; one device or an odd vocabulary has none."""
    llama = pi.load_model("llama-3-8b", 8)
    cluster, wl, plan_ = pi.Cluster(pi.GPUS["h100"]), pi.Workload(), MeshPlan(1, 2, 1)
    step = pm.decode_step(llama, pm.shapes_of(llama, plan_), plan_, cluster, wl, 16, 1024)
    bw, lat = cluster.link(2)
    one = 16 * 4096 * 2 / bw + lat  # ring over 2: each device sends half of the message twice
    assert lat == pytest.approx(pi.GPUS["h100"].nvlink_latency_us * 1e-6)
    assert step.t_comm == pytest.approx(8 * 2 * one + one)
    assert pm.embedding_all_reduce(llama, MeshPlan(), cluster, 16, 2) == 0
    odd = config_from_dict(dict(TINY_DENSE))  # vocabulary 250 is not split over 4
    assert pm.embedding_all_reduce(odd, MeshPlan(1, 4, 1), cluster, 16, 2) == 0


def test_validation_predicts_the_peak_from_its_parts():
    """A point's predicted peak: exact weights, the KV pool the run allocated, activations."""
    from pallasite.tools.plan import predict
    rec = dict(model="llama-3-8b-8L", plan="dp=1,tp=1,ep=1", phase="decode", batch=16,
               length=1024, tokens=16, num_pages=4161)
    peak = predict.predict_peak(rec)
    act = pm.activation_bytes(pi.load_model("llama-3-8b", 8), MeshPlan(), 16, 16, 1025)
    assert peak["predicted_weights_gb"] == 5.591146496
    assert peak["predicted_kv_gb"] == 4161 * 16 * (2 * 8 * 8 * 128 * 2) / 1e9
    assert peak["predicted_peak_gb"] == pytest.approx(5.591146496 + 4161 * 16 * 32768 / 1e9 +
                                                      act / 1e9)


def test_repredict_keeps_measurements(tmp_path, capsys):
    from pallasite.tools.plan import measure, predict, validate as pv
    old = dict(model="llama-3-8b-8L", plan="dp=1,tp=1,ep=1", phase="prefill", batch=1,
               length=1024, tokens=1024, measured_ms=7.0, predicted_ms=1.0, rel_error=-0.9,
               predicted_peak_gb=1.0, measured_peak_gb=8.0, gpu="NVIDIA H100 80GB HBM3")
    new = old | dict(num_pages=65)
    path = tmp_path / "old.json"
    path.write_text(json.dumps([old, new, dict(kind=measure.MICRO, plan="dp=1,tp=1,ep=1")]))
    assert pv.main(["--repredict", str(path), "--out", str(tmp_path / "out")]) == 0
    got = json.loads((tmp_path / "out" / "plan_validation.json").read_text())
    assert len(got) == 2 and all(r["measured_ms"] == 7.0 for r in got)
    assert got[0]["rel_error"] == pytest.approx(got[0]["predicted_ms"] / 7.0 - 1)
    assert got[0]["predicted_peak_gb"] == 1.0  # no KV pool recorded: kept
    want = predict.predict_peak(new)["predicted_peak_gb"]
    assert got[1]["predicted_peak_gb"] == pytest.approx(want)
    assert "llama-3-8b-8L" in capsys.readouterr().out


def test_weights_made_one_tensor_at_a_time():
    import jax.numpy as jnp
    from pallasite.sharding import Layout, make_mesh
    from pallasite.tools.plan import measure
    config = config_from_dict(TINY_DENSE)
    layout = Layout(config, make_mesh(MeshPlan(), jax.devices()[:1]))
    params = measure.make_weights(config, layout, jnp.bfloat16)
    want = param_shapes(config, jnp.bfloat16)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == \
        jax.tree.map(lambda x: (x.shape, x.dtype), want)
    assert bool(jnp.all(params["final_norm"]["scale"] == 1))
    w = params["layers_0"]["mlp"]["w_up"].astype(jnp.float32)
    assert 0.015 < float(jnp.std(w)) < 0.025
    assert not bool(jnp.all(w == params["layers_1"]["mlp"]["w_up"].astype(jnp.float32)))


def test_all_reduce_microbenchmark_keeps_every_all_reduce():
    """The chain the validation run times holds as many all-reduces as it asks for (none is
    folded away), and the microbenchmark reports one time per message size."""
    script = textwrap.dedent("""
        import json, re, jax, jax.numpy as jnp
        from pallasite.tools.plan import measure
        mesh, fn = measure.allreduce_chain(2, 8)
        text = fn.lower(jax.ShapeDtypeStruct((4, 64), jnp.bfloat16)).compile().as_text()
        count = len(re.findall(r" all-reduce(?:-start)?\\(", text))
        us = measure.allreduce_us(2, 64, (1, 4), chain=4, reps=2)
        print(json.dumps(dict(count=count, us=us)))
    """)
    out = run_on_fake_devices(script, 2)
    assert out["count"] == 8
    assert set(out["us"]) == {"1", "4"} and all(v > 0 for v in out["us"].values())


def test_fp8_weights_are_priced_as_the_code_stores_them():
    """`--quantization fp8`: linear layers one byte, the embedding and LM head in bf16; a
    batch-1 decode step reads those bytes; prefill's dense products run at the FP8 rate."""
    config = pi.load_model("llama-3-8b")
    plan_, cluster = MeshPlan(), pi.Cluster(pi.GPUS["h100"])
    shapes = pm.shapes_of(config, plan_)
    bf16, fp8 = pi.Workload(), pi.Workload(quantization="fp8")
    table = 2 * config.vocab_size * config.hidden_size  # embedding and head elements
    mem = pm.memory(config, shapes, plan_, cluster, fp8)
    assert mem.weights == (shapes.total - table) + 2 * table
    d_bf16, d_fp8 = (pm.decode_step(config, shapes, plan_, cluster, wl, 1, 1024)
                     for wl in (bf16, fp8))
    head = config.vocab_size * config.hidden_size * 2
    assert d_bf16.hbm_bytes - d_fp8.hbm_bytes == pytest.approx(
        (shapes.total - table) * 1, rel=1e-6)
    assert d_fp8.time < 0.65 * d_bf16.time and head < d_fp8.hbm_bytes
    p_bf16, p_fp8 = (pm.prefill_step(config, shapes, plan_, cluster, wl, 2, 1024)
                     for wl in (bf16, fp8))
    assert p_fp8.t_compute < 0.6 * p_bf16.t_compute
    args = plan.parser().parse_args(["llama-3-8b", "--quantization", "fp8"])
    assert plan.workload(args).quantization == "fp8"


def test_integer_weights_are_priced_as_the_code_stores_them():
    """`--quantization w4a16 / w8a16`: dense linear layers in half a byte plus a float32 scale
    per group of 128 (one byte), the embedding, the LM head and the experts as loaded; above
    the kernel's rows the weights are dequantized to bf16 every step, and those bytes move."""
    config = pi.load_model("llama-3-8b")
    plan_, cluster = MeshPlan(), pi.Cluster(pi.GPUS["h100"])
    shapes = pm.shapes_of(config, plan_)
    dense = shapes.device["dense"]
    wls = {q: pi.Workload(quantization=q) for q in (None, "w4a16", "w8a16")}
    dec = {q: pm.decode_step(config, shapes, plan_, cluster, wl, 1, 1024) for q, wl in wls.items()}
    assert dec[None].hbm_bytes - dec["w4a16"].hbm_bytes == pytest.approx(dense * (2 - 17 / 32))
    assert dec[None].hbm_bytes - dec["w8a16"].hbm_bytes == pytest.approx(dense * 1.0)
    assert dec["w4a16"].time < dec["w8a16"].time < dec[None].time
    mem = {q: pm.memory(config, shapes, plan_, cluster, wl) for q, wl in wls.items()}
    assert mem[None].weights - mem["w4a16"].weights == pytest.approx(dense * (2 - 17 / 32))
    pre = {q: pm.prefill_step(config, shapes, plan_, cluster, wls[q], 2, 1024)
           for q in (None, "w4a16")}  # 2048 tokens: past the kernel's rows
    assert pre["w4a16"].hbm_bytes - pre[None].hbm_bytes == pytest.approx(
        dense * (17 / 32 + 2 * 2 - 2))
    moe = pi.load_model("mixtral-8x7b")
    moe_shapes = pm.shapes_of(moe, plan_)
    experts = lambda wl: pm.memory(moe, moe_shapes, plan_, cluster, wl).weights
    assert experts(pi.Workload()) - experts(pi.Workload(quantization="w4a16")) == \
        pytest.approx((moe_shapes.device["dense"] + moe_shapes.device["experts"])
                      * (2 - 17 / 32))  # the experts are packed too
    # packed experts take their grouped kernel even at one token, reading INT4 bytes
    step = {q: pm.decode_step(moe, moe_shapes, plan_, cluster, pi.Workload(quantization=q), 1,
                              1024) for q in (None, "w4a16")}
    assert step["w4a16"].hbm_bytes < step[None].hbm_bytes - moe_shapes.device["dense"]
    args = plan.parser().parse_args(["llama-3-8b", "--quantization", "w4a16"])
    assert plan.workload(args).quantization == "w4a16"
    rec = psearch.evaluate(config, MeshPlan(1, 2, 1), pi.Cluster(pi.GPUS["h100"], 2),
                           wls["w4a16"])  # the loader keeps integer weights whole
    assert rec["status"] == "invalid" and "tensor=1" in rec["reason"]
    with pytest.raises(SystemExit):
        plan.parser().parse_args(["llama-3-8b", "--quantization", "int3"])


def test_sliding_windows_bound_the_kv_priced():
    """A window on every layer caps the K/V a decode step reads and the pages a sequence holds
    (the engine frees what the window has passed); a window on half the layers caps half."""
    base = dict(pi.PRESETS["llama-3-8b"], model_type="mistral", max_position_embeddings=65536)
    every = config_from_dict(dict(base, sliding_window=4096))
    half = config_from_dict(dict(base, model_type="gemma2", sliding_window=4096,
                                 head_dim=128, query_pre_attn_scalar=128))
    full = config_from_dict(dict(base, model_type="llama"))
    plan_, cluster = MeshPlan(), pi.Cluster(pi.GPUS["h100"])
    wl = pi.Workload(prompt=pi.Lengths(30720, 30720), output=pi.Lengths(2048, 2048))
    kv = lambda c, ctx: pm.decode_step(c, pm.shapes_of(c, plan_), plan_, cluster, wl, 8,
                                       ctx).hbm_bytes
    read = lambda c, ctx: kv(c, ctx) - kv(c, 0)  # the cached K/V alone
    assert read(every, 32768) == pytest.approx(read(full, 4096), rel=1e-3)
    assert read(half, 32768) == pytest.approx((read(full, 4096) + read(full, 32768)) / 2,
                                              rel=1e-3)
    assert pm.causal_pairs(every, 10) == 55 and pm.causal_pairs(
        config_from_dict(dict(base, sliding_window=4)), 10) == 4 * 5 / 2 + 6 * 4
    memory = lambda c: pm.memory(c, pm.shapes_of(c, plan_), plan_, cluster, wl)
    assert memory(every).kv_seqs > 5 * memory(full).kv_seqs
    assert memory(half).kv_seqs == pytest.approx(memory(full).kv_seqs, rel=0.3)
