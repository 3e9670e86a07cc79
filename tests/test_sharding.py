"""The model, its KV cache and the serving engine on meshes of 8 fake CPU devices give what one
device gives (float32, relative error <= 1e-5); params and KV pages really are split; bad plans
are refused before anything compiles, with a message that says what would fit.

JAX fixes its device count when it starts and the rest of the suite wants one device, so the
mesh tests run in one child pytest with XLA_FLAGS set: one process, so the models, reference
outputs and compiled steps are shared by every test. To run them directly:
`XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/test_sharding.py`.
"""

import argparse
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

FAKE_DEVICES = "--xla_force_host_platform_device_count=8"
ON_8_DEVICES = FAKE_DEVICES in os.environ.get("XLA_FLAGS", "")
mesh_test = pytest.mark.skipif(not ON_8_DEVICES, reason="runs in the 8-device child process")
parent_only = pytest.mark.skipif(ON_8_DEVICES, reason="runs in the parent process")


@parent_only
def test_the_mesh_tests_pass_on_8_fake_devices():
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FAKE_DEVICES}"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "-p", "no:randomly", os.path.basename(__file__)], env=env,
                          capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    report = done.stdout[-8000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    # Only the parent's tests may skip there: a skipped mesh test would be a missing check.
    assert re.search(r"\b\d+ passed, 3 skipped\b", report), report


TWO_PROCESSES = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, numpy as np
from jax.experimental import multihost_utils
from pallasite.sharding import Layout, MeshPlan, initialize_distributed, make_mesh
initialize_distributed(sys.argv[1], 2, int(sys.argv[2]))
from test_sharding import IDS, dense_model
config, params = dense_model()
layout = Layout(config, make_mesh(MeshPlan(1, 4, 1)))  # 2 devices in each process
assert jax.process_count() == 2 and jax.device_count() == 4
logits = layout.forward_logits()(layout.place_params(params), IDS)
np.save(sys.argv[3], np.asarray(multihost_utils.process_allgather(logits, tiled=True)))
"""


@parent_only
def test_two_processes_form_one_mesh(tmp_path):
    """Two processes on loopback (jax.distributed, CPU collectives), two devices each, run one
    tp=4 mesh: both get the one-device logits."""
    import socket
    from pallasite.model import forward_logits
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    here = os.path.dirname(os.path.abspath(__file__))
    procs = [subprocess.Popen([sys.executable, "-c", TWO_PROCESSES, f"localhost:{port}", str(i),
                               str(tmp_path / f"{i}.npy")], env=env, cwd=here,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    config, params = dense_model()
    want = forward_logits(params, config, IDS)
    for i in range(2):
        assert rel_err(np.load(tmp_path / f"{i}.npy"), want) <= 1e-5


# -- models --------------------------------------------------------------------------------------

def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def dense_model():
    """Qwen2-shaped (q/k/v biases, tied embeddings): 8 heads so tp=8 splits them, 2 kv heads so
    tp=4 and 8 copy kv heads while tp=2 splits them."""
    from pallasite.model import config_from_dict, init_params
    config = config_from_dict(dict(
        model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=True))
    # Larger weights than the 0.02 init, so the logits differ clearly between tokens. Under one
    # jit: eagerly, the init's forward pass compiles op by op (seconds per process).
    return config, jax.jit(lambda: jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x + 0.1,
                                                init_params(config, seed=3)))()


@pytest.fixture(scope="module")
def dense():
    return dense_model()


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """A random Mixtral checkpoint (4 experts, top 2), loaded through the HF loader."""
    import hf_models
    folder = tmp_path_factory.mktemp("mixtral")
    hf_models.save("mixtral", folder)
    from pallasite.model import load_hf
    config, params = load_hf(folder, dtype=jnp.float32)
    return folder, config, params


@pytest.fixture(scope="module")
def moe(moe_checkpoint):
    return moe_checkpoint[1:]


# -- the reference: one device -------------------------------------------------------------------

IDS = np.random.default_rng(0).integers(0, 128, (4, 16)).astype(np.int32)  # batch 4: dp=2 splits

PAGE_SIZE, NUM_PAGES, T, S, WIDTH = 4, 32, 16, 3, 8  # WIDTH: pages per sequence
LENGTHS = (22, 13)
# Ragged steps (sequence, first token, end): chunked prefill, then prefill beside decode, then
# decode. Every step is padded to T tokens and S sequences so one compile serves them all.
STEPS = [[(0, 0, 9), (1, 0, 5)], [(0, 9, 20)], [(0, 20, 21), (1, 5, 12)], [(0, 21, 22), (1, 12, 13)]]


def paged_batches(vocab):
    """(tokens, positions, Batch) per step over pages handed out in random order (page 0 unused)."""
    from pallasite.model import Batch
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, vocab, n) for n in LENGTHS]
    order = rng.permutation(np.arange(1, NUM_PAGES))
    tables = np.zeros((S, WIDTH), np.int32)
    tables[0], tables[1] = order[:WIDTH], order[WIDTH:2 * WIDTH]
    out = []
    for chunks in STEPS:
        tok, pos, slot = np.zeros(T, np.int32), np.zeros(T, np.int32), np.full(T, -1, np.int32)
        qstart, ctx, last = np.zeros(S + 1, np.int32), np.zeros(S, np.int32), np.zeros(S, np.int32)
        at = 0
        for i, (s, a, b) in enumerate(chunks):
            p = np.arange(a, b)
            tok[at:at + b - a], pos[at:at + b - a] = seqs[s][a:b], p
            slot[at:at + b - a] = tables[s][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
            at += b - a
            qstart[i + 1:], ctx[i], last[i] = at, b, at - 1
        table = np.zeros_like(tables)
        table[:len(chunks)] = tables[[s for s, _, _ in chunks]]
        out.append((tok, pos, Batch(*map(jnp.asarray, (qstart, ctx, table, slot, last)))))
    return out


def run_paged(step, params, kv, batches):
    """Logits of each step's real sequences, and the last KV cache, as numpy."""
    logits = []
    for (tok, pos, batch), chunks in zip(batches, STEPS):
        out, kv = step(params, tok, pos, kv, batch)
        logits.append(np.asarray(out)[:len(chunks)])
    return logits, [(np.asarray(k), np.asarray(v)) for k, v in kv]


def reference(config, params):
    from pallasite.model import forward, forward_logits, init_kv_cache
    logits = np.asarray(jax.jit(lambda p, i: forward_logits(p, config, i))(params, IDS))
    step = jax.jit(lambda p, t, q, kv, b: forward(p, config, t, q, kv, b), donate_argnums=3)
    kv = init_kv_cache(config, NUM_PAGES, PAGE_SIZE, jnp.float32)
    return logits, run_paged(step, params, kv, paged_batches(config.vocab_size))


@pytest.fixture(scope="module")
def dense_ref(dense):
    return reference(*dense)


@pytest.fixture(scope="module")
def moe_ref(moe):
    return reference(*moe)


# -- what each device must hold ------------------------------------------------------------------

def local_shapes(x):
    """The shape of every device's piece of `x`."""
    return {s.device: s.data.shape for s in x.addressable_shards}


def check_split(x, spec, shard):
    """`x` is laid out by `spec` and every one of the 8 devices' pieces has shape `shard`."""
    assert x.sharding.spec == spec, (x.sharding.spec, spec)
    assert len(x.sharding.device_set) == x.sharding.mesh.size
    assert set(local_shapes(x).values()) == {shard}, local_shapes(x)


def check_dense_params(params, plan):
    """Megatron split, written out by hand: heads, MLP units and the vocabulary over tensor."""
    t, d, h, kv, hd, f, vocab = plan.tensor, 64, 8, 2, 8, 128, 256
    layer = params["layers_1"]
    kv_spec, kv_shard = (("tensor", kv // t) if kv % t == 0 else (None, kv))
    check_split(layer["attn"]["wq"], P(None, "tensor", None), (d, h // t, hd))
    check_split(layer["attn"]["bq"], P("tensor", None), (h // t, hd))
    check_split(layer["attn"]["wk"], P(None, kv_spec, None), (d, kv_shard, hd))
    check_split(layer["attn"]["wo"], P("tensor", None, None), (h // t, hd, d))
    check_split(layer["mlp"]["w_gate"], P(None, "tensor"), (d, f // t))
    check_split(layer["mlp"]["w_down"], P("tensor", None), (f // t, d))
    check_split(layer["attn_norm"]["scale"], P(None), (d,))
    check_split(params["embed"], P("tensor", None), (vocab // t, d))


def check_moe_params(params, plan):
    """Experts over expert, each expert's MLP units over tensor; the router everywhere."""
    e, t, d, f = plan.expert, plan.tensor, 64, 96
    moe = params["layers_0"]["moe"]
    check_split(moe["w_gate"], P("expert", None, "tensor"), (4 // e, d, f // t))
    check_split(moe["w_up"], P("expert", None, "tensor"), (4 // e, d, f // t))
    check_split(moe["w_down"], P("expert", "tensor", None), (4 // e, f // t, d))
    check_split(moe["router"], P(None, None), (d, 4))
    check_split(params["lm_head"], P(None, "tensor"), (d, 128 // t))


def check_same_kv(sharded, ref, config, plan):
    """The sharded pages hold the one-device pages; with fewer kv heads than tensor shards, head
    copy j holds the kv head that shard j's query heads read."""
    kv, t = config.num_kv_heads, plan.tensor
    heads = list(range(kv)) if kv % t == 0 else [j * kv // t for j in range(t)]
    for (k, v), (rk, rv) in zip(sharded, ref):
        assert rel_err(k, rk[heads]) <= 1e-5 and rel_err(v, rv[heads]) <= 1e-5


def check_mesh(config, params_on_mesh, layout, ref):
    """forward_logits and the paged forward on the mesh equal the one-device results."""
    ref_logits, (ref_steps, ref_kv) = ref
    logits = layout.forward_logits()(params_on_mesh, IDS)
    assert logits.shape == ref_logits.shape
    assert rel_err(logits, ref_logits) <= 1e-5
    kv = layout.init_kv_cache(NUM_PAGES, PAGE_SIZE, jnp.float32)
    for k, _ in kv:  # pages split by head over tensor, whole over data and expert
        heads = k.shape[0] // layout.plan.tensor
        check_split(k, P("tensor", None, None, None),
                    (heads, NUM_PAGES, PAGE_SIZE, config.head_dim))
    steps, last_kv = run_paged(layout.forward(), params_on_mesh, kv,
                               paged_batches(config.vocab_size))
    for got, want in zip(steps, ref_steps):
        assert rel_err(got, want) <= 1e-5
    check_same_kv(last_kv, ref_kv, config, layout.plan)


# -- dense: tensor and data parallel -------------------------------------------------------------

@mesh_test
# tp2 and tp4 alone run in the newer families' cases below (gemma3-tp2, phi3-tp4).
@pytest.mark.parametrize("shape", [(1, 8, 1), (2, 4, 1)], ids=["tp8", "dp2xtp4"])
def test_dense_model_on_a_mesh_equals_one_device(dense, dense_ref, shape):
    from pallasite.sharding import Layout, MeshPlan, make_mesh
    config, params = dense
    layout = Layout(config, make_mesh(MeshPlan(*shape)))
    on_mesh = layout.place_params(params)
    check_dense_params(on_mesh, layout.plan)
    check_mesh(config, on_mesh, layout, dense_ref)


@mesh_test
def test_attention_over_several_devices_takes_the_triton_kernels(dense, monkeypatch):
    """On a mesh of more than one device the attention hook traces its kernels inside
    `kernels.portable_backends`: where a Hopper GPU would pick the Mosaic GPU flash kernel, a
    tp=2 shard takes Triton and a one-device mesh still takes Mosaic GPU."""
    from pallasite import kernels
    from pallasite.sharding import MeshPlan, make_mesh
    from pallasite.sharding.parallel import MeshHooks
    monkeypatch.setattr(kernels, "_is_hopper", lambda: True)
    config, _ = dense
    q = jnp.ones((1, 128, 8, 64), jnp.bfloat16)  # shapes the Mosaic GPU kernel takes
    k = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    for shape, want in (((1, 2, 1), "triton"), ((1, 1, 1), "mosaic")):
        seen = []

        def attend(q, k, v, *rest):
            seen.append(kernels.flash_backend(q, k))
            return q, None
        MeshHooks(config, make_mesh(MeshPlan(*shape))).attention(attend, q, k, k)
        assert seen == [want]
    assert kernels.flash_backend(q, k) == "mosaic"  # the choice is back outside the hook


# -- MoE: expert parallel, loaded straight onto the mesh -----------------------------------------

@mesh_test
@pytest.mark.parametrize("shape", [(1, 1, 4), (1, 2, 2), (2, 2, 2)],
                         ids=["ep4", "ep2xtp2", "dp2xep2xtp2"])
def test_moe_model_on_a_mesh_equals_one_device(moe_checkpoint, moe_ref, shape):
    from pallasite.model import load_hf
    from pallasite.sharding import Layout, MeshPlan, make_mesh, param_shardings
    folder, config, _ = moe_checkpoint
    layout = Layout(config, make_mesh(MeshPlan(*shape)))
    _, on_mesh = load_hf(folder, dtype=jnp.float32, shardings=param_shardings(config, layout.mesh))
    check_moe_params(on_mesh, layout.plan)
    check_mesh(config, on_mesh, layout, moe_ref)


# -- newer families: windows, soft caps, Gemma's norms and Phi-3's fused weights, same rules ----

@mesh_test
@pytest.mark.parametrize("family,shape", [("gemma3", (1, 2, 1)), ("gemma2", (2, 2, 1)),
                                          ("phi3", (1, 4, 1)), ("qwen2_window", (1, 4, 1)),
                                          ("gpt_oss", (1, 2, 2))],
                         ids=["gemma3-tp2", "gemma2-dp2xtp2", "phi3-tp4", "qwen2_window-tp4",
                              "gpt_oss-ep2xtp2"])
def test_newer_families_on_a_mesh_equal_one_device(family, shape, tmp_path):
    import hf_models
    from pallasite.model import load_hf
    from pallasite.sharding import Layout, MeshPlan, make_mesh, param_shardings
    hf_models.save(family, tmp_path)
    config, params = load_hf(tmp_path, dtype=jnp.float32)
    layout = Layout(config, make_mesh(MeshPlan(*shape)))
    _, on_mesh = load_hf(tmp_path, dtype=jnp.float32,
                         shardings=param_shardings(config, layout.mesh))
    t, e, d, hd = layout.plan.tensor, layout.plan.expert, config.hidden_size, config.head_dim
    layer = on_mesh["layers_0"]
    check_split(layer["attn"]["wq"], P(None, "tensor", None), (d, 4 // t, hd))
    if config.is_moe:  # GPT-OSS: sinks with the heads, expert biases with their experts
        f = config.moe_intermediate_size
        check_split(layer["attn"]["sinks"], P("tensor"), (4 // t,))
        check_split(layer["moe"]["w_up"], P("expert", None, "tensor"), (4 // e, d, f // t))
        check_split(layer["moe"]["b_up"], P("expert", "tensor"), (4 // e, f // t))
        check_split(layer["moe"]["b_down"], P("expert", None), (4 // e, d))
    else:
        check_split(layer["mlp"]["w_up"], P(None, "tensor"), (d, 96 // t))
    check_mesh(config, on_mesh, layout, reference(config, params))


@mesh_test
def test_fp8_weights_on_a_mesh(moe_checkpoint, dense):
    """FP8 weights quantized on load straight onto an ep2 x tp2 mesh, and placed on a tp4 mesh:
    values split like the plain weights, scales along the output axes (copied where their axis
    has size one), and the logits those of the same FP8 weights on one device. Dense
    projections are stored [out..., in...] (quant.py k_last), the experts as they are."""
    from pallasite.model import forward_logits, load_hf, quant
    from pallasite.sharding import Layout, MeshPlan, make_mesh, param_shardings
    folder, config, _ = moe_checkpoint
    layout = Layout(config, make_mesh(MeshPlan(1, 2, 2)))
    _, on_mesh = load_hf(folder, dtype=jnp.float32, quantization="fp8",
                         shardings=param_shardings(config, layout.mesh))
    moe, attn = on_mesh["layers_0"]["moe"], on_mesh["layers_0"]["attn"]
    check_split(moe["w_down"].q, P("expert", "tensor", None), (2, 48, 64))
    check_split(moe["w_down"].scale, P("expert", None, None), (2, 1, 64))
    check_split(moe["w_gate"].scale, P("expert", None, "tensor"), (2, 1, 48))
    check_split(attn["wo"].scale, P(None, None, None), (64, 1, 1))  # [d, 1, 1] of [d, h, hd]
    _, one = load_hf(folder, dtype=jnp.float32, quantization="fp8")
    one_device = jax.jit(forward_logits, static_argnums=1)  # eagerly it compiles op by op
    want = one_device(one, config, IDS)
    assert rel_err(layout.forward_logits()(on_mesh, IDS), want) <= 1e-5

    config, params = dense
    layout = Layout(config, make_mesh(MeshPlan(1, 4, 1)))
    qp = quant.quantize_params(params)
    placed = layout.place_params(qp)
    check_split(placed["layers_1"]["attn"]["wq"].q, P("tensor", None, None), (2, 8, 64))
    check_split(placed["layers_1"]["attn"]["wq"].scale, P("tensor", None, None), (2, 8, 1))
    check_split(placed["layers_1"]["mlp"]["w_down"].scale, P(None, None), (64, 1))
    want = one_device(qp, config, IDS)
    assert rel_err(layout.forward_logits()(placed, IDS), want) <= 1e-5


@mesh_test
def test_the_cpu_stand_in_for_ragged_all_to_all_is_exact():
    """The stand-in for the ragged all-to-all (CPU has none) equals the collective's definition:
    slice i of each shard lands at its offset on shard i; the other rows are left as they were."""
    from pallasite.sharding.experts import dense_ragged_all_to_all
    from pallasite.sharding.parallel import shard_map
    from pallasite.sharding import MeshPlan, make_mesh
    mesh = make_mesh(MeshPlan(1, 1, 4))
    n, ep = 6, 4
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ep, n, 3)).astype(np.float32)
    sizes = rng.integers(0, 3, (ep, ep)).astype(np.int32)  # [sender, receiver], <= n // ep
    send_off = np.cumsum(sizes, 1) - sizes
    recv_off = (np.cumsum(sizes, 0) - sizes).T.copy()  # [receiver, sender]: senders back to back
    want = np.full((ep, ep * n, 3), -1.0, np.float32)
    for s in range(ep):
        for r in range(ep):
            k = sizes[s, r]
            want[r, recv_off[r, s]:recv_off[r, s] + k] = x[s, send_off[s, r]:send_off[s, r] + k]

    def one(x, send_off, send_sizes, out_off, recv_sizes):
        out = jnp.full((ep * n, 3), -1.0, jnp.float32)
        return dense_ragged_all_to_all(x[0], out, send_off[0], send_sizes[0], out_off[0],
                                       recv_sizes[0], axis_name="expert", axis_size=ep,
                                       max_slice=n)[None]

    spec = P("expert")
    # Each sender names where its slice lands on each receiver.
    out_off = np.stack([recv_off[:, s] for s in range(ep)])
    got = shard_map(one, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec, check_vma=False)(
        x, send_off.astype(np.int32), sizes, out_off.astype(np.int32), sizes.T.copy())
    np.testing.assert_array_equal(np.asarray(got), want)


# -- serving: tensor parallel engine, data-parallel replicas -------------------------------------

ENGINE = dict(num_pages=48, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=64, token_buckets=[4, 16], page_buckets=[16])


def engine_requests():
    from test_engine import GREEDY, prompts
    from pallasite.serving.llm import SamplingParams
    reqs = [(f"m{i}", p, SamplingParams(max_tokens=10, **GREEDY))
            for i, p in enumerate(prompts(6, 3, 30, seed=1))]
    reqs.append(("pen", prompts(1, 10, 11, seed=2)[0],
                 SamplingParams(max_tokens=10, repetition_penalty=1.3, **GREEDY)))
    return reqs


def serve(engine, requests):
    """Every request's tokens, all added at once; nothing compiles after warm-up."""
    warm = engine.compilations
    for rid, prompt, sp in requests:
        engine.add_request(rid, prompt, sp)
    tokens = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.compilations == warm
    return tokens


@pytest.fixture(scope="module")
def one_device_tokens():
    from test_engine import CONFIG, PARAMS
    from pallasite.serving.engine import Engine
    got = serve(Engine(CONFIG, PARAMS, **ENGINE).warmup(), engine_requests())
    assert all(len(t) == 10 for t in got.values())
    return got


@mesh_test
def test_engine_on_tensor_parallel_mesh_gives_the_same_tokens(one_device_tokens):
    from test_engine import CONFIG, PARAMS
    from pallasite.serving.engine import Engine
    from pallasite.sharding import MeshPlan, make_mesh
    engine = Engine(CONFIG, PARAMS, mesh=make_mesh(MeshPlan(1, 2, 1)), **ENGINE).warmup()
    check_split(engine.params["layers_0"]["attn"]["wk"], P(None, "tensor", None), (64, 1, 16))
    assert serve(engine, engine_requests()) == one_device_tokens


@mesh_test
def test_llm_on_dp2_x_tp2_serves_through_replicas(one_device_tokens):
    """LLM on a data=2 mesh: one engine per data slice (each tensor parallel over its two
    devices) behind the front door, which spreads the requests; the tokens are one device's."""
    from test_engine import CONFIG, PARAMS
    from pallasite.serving.llm import LLM
    from pallasite.serving.replicas import Replicas
    from pallasite.sharding import MeshPlan, make_mesh
    mesh = make_mesh(MeshPlan(2, 2, 1))
    reqs = engine_requests()
    with LLM.from_params(CONFIG, PARAMS, mesh=mesh, **ENGINE) as llm:
        front = llm.engine
        assert isinstance(front, Replicas) and len(front.replicas) == 2
        done = llm.generate([p for _, p, _ in reqs], [sp for _, _, sp in reqs])
    assert {rid: c.token_ids for (rid, _, _), c in zip(reqs, done)} == one_device_tokens
    slices = [set(r.params["embed"].sharding.device_set) for r in front.replicas]
    assert slices == [set(mesh.devices[i].flat) for i in range(2)]
    for r in front.replicas:
        check_split(r.params["layers_0"]["attn"]["wq"], P(None, "tensor", None), (64, 2, 16))
        assert r.stats()["steps"] > 0  # both replicas served requests
    assert front.stats()["pages_used"] == 0 and not front.owner


# -- invalid plans -------------------------------------------------------------------------------

_compiles = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *a, **k: _compiles.__setitem__(0, _compiles[0] + (
        event == "/jax/core/compile/backend_compile_duration")))


def refused(match, fn, *args, **kwargs):
    """fn(*args) raises PlanError matching `match`, and compiles nothing on the way."""
    from pallasite.sharding import PlanError
    before = _compiles[0]
    with pytest.raises(PlanError, match=match):
        fn(*args, **kwargs)
    assert _compiles[0] == before


@mesh_test
def test_tensor_size_must_divide_the_heads(dense):
    from pallasite.serving.engine import Engine
    from pallasite.sharding import Layout, MeshPlan, PlanError, make_mesh
    config, params = dense
    tp3 = make_mesh(MeshPlan(1, 3, 1))
    refused(r"tensor=3 does not divide num_heads=8; tensor sizes that fit this model: \[1, 2, 4, 8\]",
            Layout, config, tp3)
    kv3 = config.replace(num_heads=6, num_kv_heads=3, intermediate_size=96)
    refused(r"tensor=2 and num_kv_heads=3: one must divide the other.*sizes that fit: \[1, 3, 6\]",
            Layout, kv3, make_mesh(MeshPlan(1, 2, 1)))
    with pytest.raises(PlanError, match="tensor=3 does not divide num_heads=8"):
        Engine(config, params, mesh=tp3, **ENGINE)  # the engine asks its Layout first


@mesh_test
def test_plan_must_divide_the_devices(dense):
    from pallasite.sharding import MeshPlan, add_mesh_arguments, make_mesh, mesh_from_args
    config, _ = dense
    args = add_mesh_arguments(argparse.ArgumentParser()).parse_args(["--mesh", "dp=3"])
    refused(r"needs 3 devices, which does not divide the 8 available; plan sizes that fit: "
            r"\[1, 2, 4, 8\]", mesh_from_args, args, config)
    refused(r"needs 16 devices; 8 available", make_mesh, MeshPlan(2, 8, 1))


@mesh_test
def test_experts_must_divide_the_expert_axis(dense, moe):
    from pallasite.sharding import Layout, MeshPlan, make_mesh
    config, _ = moe
    refused(r"expert=3 does not divide num_experts=4; expert sizes that fit: \[1, 2, 4\]",
            Layout, config, make_mesh(MeshPlan(1, 1, 3)))
    refused(r"expert=2 needs a mixture-of-experts model", Layout, dense[0],
            make_mesh(MeshPlan(1, 1, 2)))


@mesh_test
def test_one_engine_refuses_a_data_axis(dense):
    from pallasite.serving.engine import Engine
    from pallasite.sharding import Layout, MeshPlan, PlanError, make_mesh
    config, params = dense
    refused(r"through serving.replicas.Replicas", Layout, config, make_mesh(MeshPlan(2, 1, 1)),
            serving=True)
    with pytest.raises(PlanError, match="through serving.replicas.Replicas"):
        Engine(config, params, mesh=make_mesh(MeshPlan(2, 1, 1)), **ENGINE)


@parent_only  # no mesh needed
def test_a_model_that_does_not_fit_names_the_plans_that_do():
    """Llama-3-70B in bf16 (141 GB) on 80 GB devices: one device is refused, and the plan the
    message names does fit while the next smaller one does not."""
    from pallasite.model import config_from_dict
    from pallasite.sharding import MeshPlan, PlanError, check_fits
    config = config_from_dict(dict(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8))
    gpu = 80 * 2**30
    with pytest.raises(PlanError, match=r"weights need 131\.\d\d GiB per device.*smallest plans "
                                        r"that fit: tp=2; tp=4; tp=8") as error:
        check_fits(config, MeshPlan(), gpu, jnp.bfloat16)
    assert "over 90% of its 80.00 GiB" in str(error.value)
    assert check_fits(config, MeshPlan(1, 2, 1), gpu, jnp.bfloat16) < 0.9 * gpu
