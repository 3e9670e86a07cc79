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
from pallasite.tools import plan, plan_model as pm

TINY_MOE = dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128,
                moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16)
TINY_DENSE = dict(model_type="llama", vocab_size=250, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
PLANS = ["1x4x1", "2x4x1", "1x2x2", "2x1x4"]


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
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    checked = 0
    for key, shards in real.items():
        name, text = key[:-5], key[-5:]
        config = config_from_dict(TINY_MOE if name == "moe" else TINY_DENSE)
        for row in pm.param_table(config, MeshPlan.parse(text)):
            assert all(tuple(s) == row["shard"] for s in shards[row["name"]]), (key, row)
            checked += 1
    assert checked > 100


def test_weights_on_one_device_are_the_eval_shape_bytes():
    config = pm.load_model("llama-3-8b")
    leaves = jax.tree.leaves(param_shapes(config))
    total = sum(math.prod(x.shape) for x in leaves)
    shapes = pm.shapes_of(config, MeshPlan())
    assert shapes.total == shapes.device_total == total == 8_030_261_248
    mem = pm.memory(config, shapes, MeshPlan(), pm.Cluster(pm.GPUS["h100"]), pm.Workload())
    assert mem.weights == 2 * total  # 16.06 GB in bf16
    assert round(mem.weights / 1e9, 2) == 16.06
    kv = mem.kv_tokens * mem.kv_per_token
    assert mem.weights + mem.workspace + kv + mem.headroom == pytest.approx(mem.budget)
    assert mem.headroom >= 0


def test_tensor_split_halves_the_split_weights_only():
    config = pm.load_model("llama-3-8b")
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
    assert pm.shapes_of(pm.load_model(name), MeshPlan()).total == count


def test_kv_bytes_per_token():
    llama = pm.load_model("llama-3-8b")
    assert pm.kv_bytes_per_token(llama, MeshPlan(), 2) == 2 * 32 * 8 * 128 * 2
    assert pm.kv_bytes_per_token(llama, MeshPlan(1, 2, 1), 2) == 2 * 32 * 4 * 128 * 2
    qwen = pm.load_model("qwen3-30b-a3b")  # 4 kv heads on 8 shards: one copied head each
    assert pm.kv_bytes_per_token(qwen, MeshPlan(1, 8, 1), 2) == 2 * 48 * 1 * 128 * 2


def test_all_reduce_volume():
    llama = pm.load_model("llama-3-8b")
    cluster = pm.Cluster(pm.GPUS["h100"])
    comm = pm.collectives(llama, MeshPlan(1, 2, 1), cluster, tokens=1, act_bytes=2)
    # Two ring all-reduces of 4096 bf16 values: each device sends 2(t-1)/t of 8192 B per one.
    assert comm["all-reduce x2"][0] == 2 * 8192
    comm8 = pm.collectives(llama, MeshPlan(1, 8, 1), cluster, tokens=1, act_bytes=2)
    assert comm8["all-reduce x2"][0] == 2 * 2 * 7 / 8 * 8192
    assert comm8["all-reduce x2"][1] > comm["all-reduce x2"][1]
    assert pm.collectives(llama, MeshPlan(), cluster, 1, 2) == {}


def test_invalid_plans_rejected_with_reasons():
    llama = pm.load_model("llama-3-8b")
    cluster = pm.Cluster(pm.GPUS["h100"], gpus_per_host=6)
    by_plan = {r["plan"]: r for r in pm.explore(llama, cluster, pm.Workload())}
    assert by_plan["dp=1,tp=6,ep=1"]["status"] == "invalid"
    assert "does not divide num_heads=32" in by_plan["dp=1,tp=6,ep=1"]["reason"]
    assert "mixture-of-experts" in by_plan["dp=3,tp=1,ep=2"]["reason"]
    assert by_plan["dp=3,tp=2,ep=1"]["status"] == "ok"


def test_plan_that_cannot_fit_says_by_how_much():
    config = pm.load_model("llama-3-70b")
    cluster = pm.Cluster(pm.GPUS["h100"])
    wl = pm.Workload()
    rec = pm.evaluate(config, MeshPlan(8, 1, 1), cluster, wl)
    assert rec["status"] == "no-fit"
    budget = pm.GPUS["h100"].memory_gib * pm.const("mem_fraction")
    weights = 70_553_706_496 * 2 / pm.GIB
    assert rec["short_gib"] > weights - budget
    assert rec["short_gib"] < weights - budget + 2  # + workspace and one sequence's KV
    assert f"{rec['short_gib']:.2f} GiB short" in rec["reason"]
    assert pm.evaluate(config, MeshPlan(2, 4, 1), cluster, wl)["status"] == "ok"


def test_decode_is_memory_bound_and_prefill_compute_bound():
    config = pm.load_model("llama-3-8b")
    plan_, cluster, wl = MeshPlan(), pm.Cluster(pm.GPUS["h100"]), pm.Workload()
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


@pytest.mark.parametrize("name", sorted(pm.PRESETS))
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
    config = pm.load_model("qwen3-30b-a3b", 2)
    plan_ = MeshPlan(1, 1, 1)
    shapes, wl = pm.shapes_of(config, plan_), pm.Workload()
    cluster = pm.Cluster(pm.GPUS["h100"], gpus_per_host=8)
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
