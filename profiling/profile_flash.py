"""Where a step of the Mosaic GPU flash kernel goes: a trace of each warpgroup's named phases.

Runs `kernels/flash_mgpu.py` once with Mosaic GPU's in-kernel profiler (`profile_dir`), then
sums each warpgroup's time per phase (`qk`, `softmax`, `wait_tc`, `pv`, `wait_q`, `epilogue`;
with `--overlap`, `wait_kv` and `qk_pv_softmax`) over all CTAs. A step's phases are sequential
in a consumer, so their means add up to its period; the profiler's clock reads stretch each.

    python -m profiling.profile_flash [--seq 4096] [--full] [--overlap] [--out $OUT]

GPU only (Hopper). Prints a table; writes the summary and the raw trace under --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.common import run_info
from pallasite.kernels import flash_mgpu

WARPGROUPS = ("consumer 0", "consumer 1", "producer")


def phase_times(trace):
    """{(warpgroup, phase): [durations in us]} from a Chrome-format trace of B/E events."""
    out = collections.defaultdict(list)
    stacks = collections.defaultdict(list)
    for e in sorted(trace["traceEvents"], key=lambda e: (e["tid"], e["ts"])):
        wg = WARPGROUPS[(e["tid"] - 1) % len(WARPGROUPS)]
        if e["ph"] == "B":
            stacks[e["tid"]].append((e["name"], e["ts"]))
        elif stacks[e["tid"]]:
            name, t0 = stacks[e["tid"]].pop()
            out[(wg, name)].append(e["ts"] - t0)
    return out


def run(B, T, H, KV, D, causal, num_ctas, overlap, profile_dir):
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.bfloat16)
    k, v = (jax.random.normal(x, (B, T, KV, D), jnp.bfloat16) for x in ks[1:])
    out = flash_mgpu.flash_attention(q, k, v, causal=causal, num_ctas=num_ctas,
                                     overlap=overlap, profile_dir=profile_dir)
    jax.block_until_ready(out)
    jax.effects_barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--num-ctas", type=int, default=None)
    ap.add_argument("--overlap", action="store_true", help="software-pipelined consumers")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp()
    # B=1 and 8 heads keep the trace small: ~2 work items per CTA.
    run(1, args.seq, args.heads, 2, 128, not args.full, args.num_ctas, args.overlap, tmp)
    [name] = [n for n in os.listdir(tmp)][-1:]
    trace = json.loads(Path(tmp, name).read_text())
    shutil.copy(Path(tmp, name), out / "flash_trace.json")
    times = phase_times(trace)
    ts = [e["ts"] for e in trace["traceEvents"]]
    summary = dict(seq=args.seq, heads=args.heads, causal=not args.full, overlap=args.overlap,
                   span_us=max(ts) - min(ts), **run_info(),
                   phases={f"{wg}/{p}": dict(count=len(d), mean_us=sum(d) / len(d),
                                             total_us=sum(d))
                           for (wg, p), d in sorted(times.items())})
    (out / "flash_profile.json").write_text(json.dumps(summary, indent=1))
    print(f"span {summary['span_us']:.1f} us over all CTAs")
    print("| warpgroup / phase | count | mean us | share of the consumer's time |")
    print("|---|---|---|---|")
    for wg in WARPGROUPS[:2]:
        total = sum(v["total_us"] for k, v in summary["phases"].items() if k.startswith(wg))
        for k, v in summary["phases"].items():
            if k.startswith(wg):
                print(f"| {k} | {v['count']} | {v['mean_us']:.3f} | "
                      f"{100 * v['total_us'] / total:.0f}% |")


if __name__ == "__main__":
    main()
