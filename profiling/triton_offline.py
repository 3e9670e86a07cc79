"""Compile a Pallas Triton kernel for the H100 (sm_90a) on a machine without a GPU and say what
Triton made of it: shared memory, registers and spill bytes (ptxas), the MMA layouts it picked,
and the async-copy waits of the first pipelined loop.

    python -m profiling.triton_offline                    # the MLA decode sweep's tiles
    python -m profiling.triton_offline --tile 64,32,8,5,1 --keep /tmp/mla

How to read it: an MMA layout warpsPerCTA [8, 1] on a 64-row product means both warpgroups
compute the same rows (Triton puts a chained dot's warps on its rows); `wait 0` at the top of
the loop means no tile is in flight while the last one is multiplied (loads and MMAs take
turns). Needs the `triton` package (its ptxas-blackwell reads the PTX it writes); a
profiling-only dependency. This is pip's Triton, not the one inside jaxlib or XLA: it guides
the GPU sweep (`benchmarks/bench_mla.py`), which decides.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def ttir(fn, *args) -> str:
    """The Triton IR of the (one) Pallas kernel in jitted `fn` at `args` (shape structs),
    lowered for CUDA on whatever machine this is."""
    from jax._src.pallas.triton import pallas_call_registration as reg
    seen, lower = [], reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        out = lower(*a, **k)
        seen.append(out.module.operation.get_asm(enable_debug_info=False))
        return out

    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        fn.trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = lower
    return seen[0]


def compile_sm90(ir_text: str, num_warps: int, num_stages: int, keep: Path) -> dict:
    """Triton's passes (as jaxlib runs them from the IR on) and ptxas for sm_90a."""
    import triton
    from triton._C.libtriton import ir, passes
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    target = GPUTarget("cuda", 90, 32)
    ctx = ir.context()
    ir.load_dialects(ctx)
    CUDABackend(target).load_dialects(ctx)
    src = keep / "kernel.ttir"
    src.write_text(ir_text)
    mod = ir.parse_mlir_module(str(src), ctx)
    pm = ir.pass_manager(ctx)  # what compiling from source does before the GPU passes
    passes.common.add_inliner(pm)
    passes.common.add_canonicalizer(pm)
    passes.ttir.add_combine(pm)  # e.g. a dot's zero accumulator plus an add -> one MMA
    passes.ttir.add_reorder_broadcast(pm)
    passes.common.add_cse(pm)
    passes.common.add_symbol_dce(pm)
    passes.ttir.add_loop_unroll(pm)
    pm.run(mod, "make_ttir")
    src.write_text(str(mod))
    k = triton.compile(str(src), target=target,
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    gir, ptx = k.asm["ttgir"], k.asm["ptx"]
    (keep / "kernel.ttgir").write_text(gir)
    (keep / "kernel.ptx").write_text(ptx)
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas-blackwell"
    log = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(keep / "kernel.ptx"), "-o",
                          str(keep / "kernel.cubin")], capture_output=True, text=True).stderr
    num = lambda pat, text: int(m.group(1)) if (m := re.search(pat, text)) else None
    loop = gir[gir.index("scf.for"):] if "scf.for" in gir else ""
    return dict(smem=k.metadata.shared, regs=num(r"Used (\d+) registers", log),
                spill_bytes=num(r"(\d+) bytes spill stores", log),
                mma=sorted({f"v{v} warps {w} instr {i or '-'}" for v, w, i in re.findall(
                    r"nvidia_mma<\{versionMajor = (\d+).*?warpsPerCTA = (\[[\d, ]+\])"
                    r"(?:, instrShape = (\[[\d, ]+\]))?", gir)}),
                loop_wait=num(r"async_wait[^{]*\{num = (\d+)", loop))


def mla_tile(tile, batch=64, context=4096, heads=128, kv_lora_rank=512, rope=64, page_size=64):
    """The MLA decode kernel at the bench's shape with `tile` (bench_mla.TILE's order)."""
    import functools

    import jax
    from benchmarks.bench_mla import TILE, inputs
    from pallasite.kernels import mla_decode as M
    kw = dict(zip(TILE, tile))
    warps, stages = kw["num_warps"], kw["num_stages"]
    args = jax.eval_shape(lambda: inputs(jax.random.PRNGKey(0), batch, context, heads,
                                         kv_lora_rank, rope, page_size))
    return ttir(jax.jit(functools.partial(M.mla_decode, sm_scale=0.1, **kw)), *args), warps, \
        stages


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tile", action="append", help="block_h,block_k,warps,stages,v_parts "
                    "(repeatable; default: bench_mla.SWEEP)")
    ap.add_argument("--keep", help="folder for the IR, PTX and cubin of the last tile")
    args = ap.parse_args()
    from benchmarks.bench_mla import SWEEP
    tiles = [tuple(int(x) for x in t.split(",")) for t in args.tile] if args.tile else SWEEP
    keep = Path(args.keep or tempfile.mkdtemp())
    keep.mkdir(parents=True, exist_ok=True)
    print("| tile (block_h, block_k, warps, stages, v_parts) | smem KiB | regs | spill B "
          "| loop wait | MMA layouts |")
    print("|---|---|---|---|---|---|")
    for tile in tiles:
        try:
            r = compile_sm90(*mla_tile(tile), keep)
            print(f"| {tile} | {r['smem'] // 1024} | {r['regs']} | {r['spill_bytes']} | "
                  f"{r['loop_wait']} | {'; '.join(r['mma'])} |", flush=True)
        except Exception as e:  # e.g. out of registers or shared memory for this tile
            print(f"| {tile} | failed: {str(e).strip().splitlines()[-1][:120]} | | | | |",
                  flush=True)


if __name__ == "__main__":
    main()
