"""profiling/step_trace.py's trace parsing: a real CPU trace of a small jitted step, and a
hand-written trace laid out as JAX writes a GPU one (device process, stream lines, lines the
profiler derives, library kernels named only by the HLO op the profiler attached)."""

import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.kernels.reference import write_kv_reference
from profiling import profile_step as ps, step_trace


def test_cpu_trace(tmp_path):
    def step(x, w, pages, slots):
        k = (x @ w).reshape(x.shape[0], 1, 8)
        pages, _ = write_kv_reference(pages, pages, k, k, slots)
        return jnp.tanh(x @ w).sum(), pages

    f = jax.jit(step, donate_argnums=2)
    x, w = jnp.ones((2, 16)), jnp.ones((16, 8))
    pages, slots = jnp.zeros((1, 4, 4, 8)), jnp.array([1, 6], jnp.int32)
    compiled = f.lower(x, w, pages, slots).compile()
    _, pages = compiled(x, w, pages, slots)
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(3):
            out, pages = compiled(x, w, pages, slots)
        out.block_until_ready()
    path = next(tmp_path.rglob("perfetto_trace.json.gz"))
    trace = step_trace.device_ops(str(path))
    assert trace["device"] == "cpu" and trace["ops"]
    b = step_trace.breakdown(trace, [step_trace.parse_hlo(compiled.as_text(), "forward")], 3, 1000, 1.0)
    assert b["unmatched_per_step"] == 0
    assert {"matmul", "KV write"} <= set(b["categories"])
    assert b["kernel_ms"] > 0 and b["busy_ms"] <= b["span_ms"] + 1e-9
    assert b["top"] and abs(sum(c["share"] for c in b["categories"].values()) - 1) < 1e-6


HLO = """HloModule jit__forward_fn, is_scheduled=true

%fused_add (p0: bf16[1,4096], p1: bf16[1,4096]) -> bf16[1,4096] {
  %p0 = bf16[1,4096]{1,0} parameter(0)
  %p1 = bf16[1,4096]{1,0} parameter(1)
  ROOT %add.1 = bf16[1,4096]{1,0} add(%p0, %p1), metadata={op_name="jit(_forward_fn)/Decoder/layers_0/add"}
}

%fused_merge (p0: f32[4,8,128]) -> bf16[8,128] {
  %p0 = f32[4,8,128]{2,1,0} parameter(0)
  %e = f32[4,8,128]{2,1,0} exponential(%p0)
  %c = f32[] constant(0)
  ROOT %r = bf16[8,128]{1,0} reduce(%e, %c), dimensions={0}, to_apply=%sum
}

ENTRY %main (a: bf16[1,4096], w: bf16[4096,128256]) -> f32[1,128256] {
  %a = bf16[1,4096]{1,0} parameter(0)
  %w = bf16[4096,128256]{1,0} parameter(1)
  %loop_add_fusion.3 = bf16[1,4096]{1,0} fusion(%a, %a), kind=kLoop, calls=%fused_add, metadata={op_name="jit(_forward_fn)/Decoder/layers_0/add"}
  %custom-call.2 = (bf16[1,128256]{1,0}, s8[1024]{0}) custom-call(%loop_add_fusion.3, %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(_forward_fn)/Decoder/Decoder.logits/dot_general"}
  %custom-call.7 = f32[4,8,128]{2,1,0} custom-call(%a), custom_call_target="triton_kernel_call_ffi", metadata={op_name="jit(_forward_fn)/Decoder/layers_0/attn/jit(ragged_paged_attention)/pallas_call"}
  %input_reduce_fusion.9 = bf16[8,128]{1,0} fusion(%custom-call.7), kind=kInput, calls=%fused_merge, metadata={op_name="jit(_forward_fn)/Decoder/layers_0/attn/jit(ragged_paged_attention)/reduce_sum"}
  ROOT %t = f32[1,128256]{1,0} get-tuple-element(%custom-call.2), index=0
}
"""


def gpu_trace(path):
    meta = [dict(ph="M", pid=1, name="process_name", args=dict(name="/device:GPU:0")),
            dict(ph="M", pid=1, tid=7, name="thread_name", args=dict(name="Stream #7(Compute)")),
            dict(ph="M", pid=1, tid=100, name="thread_name", args=dict(name="XLA Ops")),
            dict(ph="M", pid=701, name="process_name", args=dict(name="/host:CPU"))]
    kernels = []
    for step in range(2):  # 100 us a step: four kernels of 10 us and a 10 us copy
        t = 100.0 * step
        kernels += [("MemcpyH2D", {}, t), ("loop_add_fusion_3", {}, t + 15),
                    ("nvjet_hsh_64x8_1", dict(hlo_op="custom-call.2",
                                              hlo_module="jit__forward_fn"), t + 30),
                    ("pallasite_ragged_paged_attention", {}, t + 45),
                    ("input_reduce_fusion_9", {}, t + 60)]
    events = [dict(ph="X", pid=1, tid=7, ts=ts, dur=10.0, name=n, args=a) for n, a, ts in kernels]
    events += [dict(ph="X", pid=1, tid=100, ts=0.0, dur=50.0, name="fusion.1"),  # derived line
               dict(ph="X", pid=701, tid=1, ts=0.0, dur=5.0, name="add", args=dict(hlo_op="x"))]
    with gzip.open(path, "wt") as f:
        json.dump(dict(traceEvents=meta + events), f)


def test_gpu_layout(tmp_path):
    path = str(tmp_path / "perfetto_trace.json.gz")
    gpu_trace(path)
    trace = step_trace.device_ops(path)
    assert trace["device"] == "gpu" and trace["lines"] == {"Stream #7(Compute)": 10}
    b = step_trace.breakdown(trace, [step_trace.parse_hlo(HLO, "forward")], 2, 128256, wall_ms=0.1)
    cats = {k: round(v["calls"]) for k, v in b["categories"].items()}
    assert cats == {"copy/memset": 1, "norm/RoPE/elementwise": 1, "logits/lm_head": 1,
                    "attention kernel": 1, "split-K merge": 1}
    assert b["ops_per_step"] == 5 and b["unmatched_per_step"] == 2  # the copy, the Pallas kernel
    assert np.isclose(b["kernel_ms"], 0.05) and np.isclose(b["busy_ms"], 0.05)
    assert np.isclose(b["idle_ms"], 0.05) and np.isclose(b["gap_us"]["median"], 5.0)
    assert b["top"][0]["kernel"].startswith(("MemcpyH2D", "loop_add_fusion", "nvjet", "pallas",
                                             "input_reduce"))


def test_report_survives_failed_variants():
    text = ps.report([dict(variant="default", status="failed (1): Unknown flag"),
                      dict(variant="graphs_off", cases=dict(b1=dict(synced_ms=1.0,
                                                                    pipelined_ms=0.5)),
                           status="ok")])
    assert "Unknown flag" in text and "0.500" in text


def test_step_bytes_count_int4_as_two_codes_a_byte():
    from pallasite.model import config_from_dict
    from profiling.step_engine import step_bytes
    config = config_from_dict(dict(model_type="llama", vocab_size=32, hidden_size=16,
                                   intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1))
    bf16 = jnp.zeros((32, 16), jnp.bfloat16)
    params = {"embed": bf16, "lm_head": bf16,
              "layers_0": {"w": jnp.zeros((64, 128), jnp.int4), "s": jnp.zeros((64,), jnp.float32)}}
    b = step_bytes(params, config, tokens=4)
    assert b["layer_weights"] == 64 * 128 // 2 + 64 * 4
    assert b["lm_head"] == 32 * 16 * 2 and b["kv"] == 2 * 1 * 1 * 8 * 2 * 4
