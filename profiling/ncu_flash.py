"""Where the Mosaic GPU flash kernel stalls, instruction by instruction (Nsight Compute).

Times the kernel's variants beside cuDNN, then, under `ncu`, runs each asked variant once more
between cuProfilerStart/Stop so that only those launches are profiled:

    python -m profiling.ncu_flash --time [--variants late,stag,ovl]  # and cuDNN, same run
    ncu --clock-control none --profile-from-start off --section SourceCounters \\
        --section WarpStateStats -o flash python -m profiling.ncu_flash --variants late,stag
    ncu -i flash.ncu-rep --page source --csv --print-source sass | gzip > sass.csv.gz
    python -m profiling.ncu_flash --summarize sass.csv.gz  # stalls by reason, opcode, instruction

B=4, S=4096, 32/8 heads, head_dim 128, bf16, causal unless --full. GPU only (Hopper).
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io

from profiling import profile_each

# Variants of kernels/flash_mgpu.py by name: staggered consumers with P's row sum taken under
# P V (the default) or in the softmax, and pipelined consumers.
VARIANTS = {"late": dict(), "stag": dict(late_sum=False), "ovl": dict(overlap=True)}


def inputs(seq=4096):
    import jax
    import jax.numpy as jnp
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (4, seq, 32, 128), jnp.bfloat16)
    k, v = (jax.random.normal(x, (4, seq, 8, 128), jnp.bfloat16) for x in ks[1:])
    return q, k, v


def profiled(names, causal):
    """Compile each variant, then run it once inside the profiler's window."""
    import jax
    from pallasite.kernels import flash_mgpu
    q, k, v = inputs()
    profile_each([(jax.jit(lambda q, k, v, kw=VARIANTS[n]: flash_mgpu.flash_attention(
        q, k, v, causal=causal, **kw)), (q, k, v)) for n in names])


def timed(names, rounds=3, out=None):
    """Device time of cuDNN and each variant, causal and full, in `rounds` interleaved rounds
    (cuDNN's time moves between rounds too); each variant checked against cuDNN first."""
    import json
    import jax
    import numpy as np
    from pallasite.kernels import flash_mgpu
    from benchmarks.attention import cudnn_attention
    from benchmarks.common import rel_err, time_ms
    q, k, v = inputs()
    fns, times = {}, collections.defaultdict(list)
    for causal in (True, False):
        ref = jax.jit(lambda q, k, v: cudnn_attention(q, k, v, causal))(q, k, v)
        fns["cudnn", causal] = lambda q, k, v, c=causal: cudnn_attention(q, k, v, c)
        for name in names:
            fn = lambda q, k, v, kw=VARIANTS[name], c=causal: flash_mgpu.flash_attention(
                q, k, v, causal=c, **kw)
            try:
                err = rel_err(jax.jit(fn)(q, k, v), ref)
                assert err < 2e-2, err
                fns[name, causal] = fn
            except Exception as e:
                print(f"{name} causal={causal}: FAILED {type(e).__name__}: {str(e)[:300]}")
    for r in range(rounds):
        for key, fn in fns.items():
            times[key].append(time_ms(fn, q, k, v, reps=21, device=True))
            print(f"round {r} {key}: {times[key][-1]:.4f} ms", flush=True)
    med = {key: float(np.median(t)) for key, t in times.items()}
    if out:
        json.dump([dict(variant=n, causal=c, ms=t, median_ms=med[n, c])
                   for (n, c), t in times.items()], open(out, "w"), indent=1)
    print("| variant | causal ms | x cuDNN | full ms | x cuDNN |\n|---|---|---|---|---|")
    for name in ["cudnn"] + names:
        cells = []
        for c in (True, False):
            ms = med.get((name, c))
            cells += [f"{ms:.3f}" if ms else "-",
                      f"{med['cudnn', c] / ms:.3f}" if ms else "-"]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def summarize(path, top=25):
    """Stall samples of a `--page source --print-source sass` CSV, kernel by kernel: the stall
    reasons, the opcodes, then the hottest instructions."""
    text = gzip.open(path, "rt").read() if path.endswith(".gz") else open(path).read()
    for i, part in enumerate(text.split('"Kernel Name"')[1:]):
        rows = list(csv.DictReader(io.StringIO(part[part.index("\n") + 1:])))
        samples = "Warp Stall Sampling (All Samples)"
        num = lambda r, c=samples: float((r.get(c) or "0").replace(",", "") or 0)
        total = sum(num(r) for r in rows) or 1
        reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
        print(f"kernel {i}: {len(rows)} instructions, {total:.0f} samples")
        by_reason = {c: sum(num(r, c) for r in rows) for c in reasons}
        print("  " + ", ".join(f"{c[6:]} {100 * v / total:.0f}%" for c, v in
                               sorted(by_reason.items(), key=lambda x: -x[1])[:8]))
        by_op = collections.Counter()
        for r in rows:
            words = r["Source"].split()
            by_op[words[words[0].startswith("@")].split(".")[0] if words else "?"] += num(r)
        print("  " + ", ".join(f"{op} {100 * n / total:.0f}%" for op, n in by_op.most_common(12)))
        for j, r in sorted(enumerate(rows), key=lambda x: -num(x[1]))[:top]:
            why = sorted(((num(r, c), c[6:]) for c in reasons), reverse=True)[:2]
            print(f"  {j:5d} {100 * num(r) / total:5.1f}%  {r['Source'].strip()[:56]:56s} "
                  + " ".join(f"{c}={v:.0f}" for v, c in why if v))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="late,stag")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="--time: write every timing here (JSON)")
    ap.add_argument("--summarize", metavar="CSV")
    args = ap.parse_args()
    names = args.variants.split(",")
    if args.summarize:
        summarize(args.summarize)
    elif args.time:
        timed(names, args.rounds, args.out)
    else:
        profiled(names, causal=not args.full)


if __name__ == "__main__":
    main()
