"""What the L2 flush between timed calls adds to them: decode and prefill timed after a flush
that writes 128 MB (leaving the L2 full of dirty lines) and after one that reads 128 MB.

    python -m profiling.probe_flush --out $OUT

B=64 / 4k and B=256 / 4k decode (ours, JAX's paged kernel, an XLA reduction over the same K/V
bytes laid out contiguously) and causal S=4096 prefill (ours, cuDNN), in interleaved rounds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import attention as att, common


def cases():
    rng = np.random.default_rng(0)
    out = {}
    for B in (64, 256):
        q, kp, vp, _, ctx, table = att.paged_inputs(rng, [1] * B, [4096] * B, 32, 8, 128, 16,
                                                   jnp.bfloat16)
        q = q.reshape(B, 32, 128)
        out[f"decode B={B} ours"] = (lambda *a: att.K.paged_attention(*a, impl="pallas"),
                                     (q, kp, vp, ctx, table))
        out[f"decode B={B} jax paged"] = (att.jax_paged_reference, (q, kp, vp, ctx, table))
        out[f"decode B={B} xla read"] = (lambda k, v: (jnp.sum(k, axis=(1, 2), dtype=jnp.float32),
                                                      jnp.sum(v, axis=(1, 2), dtype=jnp.float32)),
                                         (kp, vp))
    q, k, v = att.dense_inputs(jax.random.PRNGKey(1), 4, 4096, 4096, 32, 8, 128, jnp.bfloat16)
    out["prefill causal ours"] = (lambda q, k, v: att.K.flash_attention(q, k, v, causal=True),
                                  (q, k, v))
    out["prefill causal cudnn"] = (lambda q, k, v: att.cudnn_attention(q, k, v, True), (q, k, v))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    times = collections.defaultdict(list)
    todo = cases()
    for r in range(args.rounds):
        for mode in ("write", "read"):
            common.FLUSH_MODE["mode"] = mode
            for name, (fn, a) in todo.items():
                times[name, mode].append(common.time_ms(fn, *a, reps=21, device=True))
                print(f"round {r} {mode} {name}: {times[name, mode][-1]:.4f} ms", flush=True)
    med = {k: float(np.median(v)) for k, v in times.items()}
    json.dump(dict(**common.run_info(),
                   times=[dict(case=n, flush=m, ms=t, median_ms=med[n, m])
                          for (n, m), t in times.items()]),
              open(os.path.join(args.out, "probe_flush.json"), "w"), indent=1)
    print("| case | write-flush ms | read-flush ms | difference us |\n|---|---|---|---|")
    for name in todo:
        w, rd = med[name, "write"], med[name, "read"]
        print(f"| {name} | {w:.4f} | {rd:.4f} | {1e3 * (w - rd):.1f} |")


if __name__ == "__main__":
    main()
