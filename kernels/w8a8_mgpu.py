"""FP8 x FP8 matrix product for Hopper (W8A8, Pallas with the Mosaic GPU backend).

xq [M, K] float8_e4m3fn with row scales xs [M, 1], times weights stored [N, K] (float8_e4m3fn,
per-output-channel scale [1, N]) -> [M, N] bfloat16. Hopper's warpgroup MMA reads 8-bit
operands from shared memory only when they run along K, so the weight must be stored [N, K]
(a [K, N] weight would need a transpose per tile; that layout goes to the Triton kernel,
`w8a8_matmul.py`). Block-wise scales (G > 1) also go there.

One CTA of one warpgroup per [block_m, block_n] output tile: TMA copies stream K tiles of x and
of the weight into a ring of `num_stages` swizzled shared-memory slots (`plgpu.emit_pipeline`)
and the warpgroup's MMA multiplies each pair. With `promote` (the default) every step's product
lands on a fresh accumulator and is added to a float32 total in registers, since Hopper's FP8
MMA keeps a long running sum at reduced precision; the epilogue multiplies the row and column
scales in registers (TMA brings them in while the product runs) and leaves through shared
memory as bf16 with one TMA store. The MMA is waited for at each step before its slots are
released; the copies of the next steps are in flight meanwhile. Three stages of 64x128 tiles
take ~90 KB of shared memory, so two CTAs share an SM and one's float32 adds run under the
other's MMAs. The jnp reference is `quant_reference.w8a8_reference` (layout "nk").

In Pallas interpret mode (the CPU tests) the product runs as a plain float32 dot of the shared
memory tiles (the interpreter has no transposed wgmma); the pipeline, scales and stores run as
written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def supported(m: int, k: int, n: int, groups: int, *, block_n: int = 128, block_k: int = 128,
              **_) -> str | None:
    """Why this kernel cannot take an [m, k] x [k, n] call ("nk" weights), or None."""
    if groups != 1:
        return f"{groups} scale groups (per-channel scales only)"
    if n % block_n:
        return f"N={n} is not a multiple of block_n={block_n}"
    if k % block_k:
        return f"K={k} is not a multiple of block_k={block_k}"
    return None


def swizzled(cols: int, dtype):
    """Shared-memory transforms for tiles whose rows are `cols` elements of `dtype`: 8-row
    tiles as wide as the largest swizzle the rows allow."""
    swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_stages",
                                             "promote", "interpret"))
def w8a8_matmul_quantized(xq, xs, q, scale, *, block_m: int = 64, block_n: int = 128,
                          block_k: int = 128, num_stages: int = 3, promote: bool = True,
                          interpret: bool = False):
    """xq [M, K] float8_e4m3fn, xs [M, 1] float32, q [N, K] float8_e4m3fn, scale [1, N]
    float32 -> [M, N] bfloat16.

    `promote`: each block_k step's MMA runs on a fresh accumulator and is added to a float32
    total in registers. Hopper's FP8 MMA keeps its running sum at reduced precision (cuBLASLt's
    "fast accumulation", ~2e-3 off the float32 product at K=4096 on the H100); adding every
    128 rows in float32 is what DeepSeek-V3's kernels do. False: one accumulator over all K."""
    if xq.dtype != jnp.float8_e4m3fn or q.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"w8a8_mgpu takes float8_e4m3fn operands, not {xq.dtype} x {q.dtype}")
    m, k = xq.shape
    n = q.shape[0]
    if q.shape[1] != k or scale.shape[1] != n:
        raise ValueError(f"w8a8_mgpu: x {xq.shape}, q {q.shape} ([N, K]) and scale "
                         f"{scale.shape} do not agree")
    why = supported(m, k, n, scale.shape[0], block_n=block_n, block_k=block_k)
    if why:
        raise ValueError(f"w8a8_mgpu: {why}")
    mp = -(-m // block_m) * block_m
    if mp != m:  # padded rows: zeros with scale 1, sliced off below
        xq = jnp.pad(xq, ((0, mp - m), (0, 0)))
        xs = jnp.pad(xs, ((0, mp - m), (0, 0)), constant_values=1.0)
    in_t, out_t = swizzled(block_k, xq.dtype), swizzled(block_n, jnp.bfloat16)
    num_stages = max(1, min(num_stages, k // block_k))

    def body(x_gmem, xs_gmem, w_gmem, s_gmem, o_gmem):
        mi, ni = lax.axis_index("m"), lax.axis_index("n")
        rows, cols = pl.ds(mi * block_m, block_m), pl.ds(ni * block_n, block_n)
        shape = (block_m, block_n)

        def pipeline(step, **kw):
            return plgpu.emit_pipeline(
                step, grid=(k // block_k,),
                in_specs=[plgpu.BlockSpec((block_m, block_k), lambda s: (0, s), transforms=in_t),
                          plgpu.BlockSpec((block_n, block_k), lambda s: (0, s),
                                          transforms=in_t)],
                max_concurrent_steps=num_stages, **kw)(x_gmem.at[rows], w_gmem.at[cols])

        def mma(acc_ref, x_smem, w_smem):
            plgpu.wgmma(acc_ref, x_smem, plgpu.transpose_ref(w_smem, (1, 0)))
            plgpu.wgmma_wait(0)  # the slots are released when the step returns

        def product():
            if interpret or promote:  # each step's product on a fresh accumulator, summed
                def step(_, x_smem, w_smem, total):
                    if interpret:
                        return total + jnp.dot(x_smem[...].astype(jnp.float32),
                                               w_smem[...].astype(jnp.float32).T)
                    return total + pl.run_scoped(
                        lambda a: (mma(a, x_smem, w_smem), a[...])[1],
                        plgpu.ACC(shape, jnp.float32))
                zeros = jnp.zeros(shape, jnp.float32)
                return pipeline(step, init_carry=zeros if interpret else
                                plgpu.layout_cast(zeros, plgpu.Layout.WGMMA))

            def whole(acc_ref):  # one accumulator over all of K
                pipeline(lambda _, x_smem, w_smem: mma(acc_ref, x_smem, w_smem))
                return acc_ref[...]
            return pl.run_scoped(whole, plgpu.ACC(shape, jnp.float32))

        def scoped(o_smem, r_smem, c_smem, ready):
            # the tile's scales come in while the product runs
            plgpu.copy_gmem_to_smem(xs_gmem.at[rows], r_smem, ready.at[0])
            plgpu.copy_gmem_to_smem(s_gmem.at[cols], c_smem, ready.at[1])
            acc = product()
            plgpu.barrier_wait(ready.at[0])
            plgpu.barrier_wait(ready.at[1])
            if interpret:
                r, c = r_smem[...], c_smem[...]
            else:
                r = plgpu.load(r_smem, (), layout=plgpu.Layout.WGMMA.reduce(1))
                c = plgpu.load(c_smem, (), layout=plgpu.Layout.WGMMA.reduce(0))
            acc = (acc * lax.broadcast_in_dim(r, shape, [0])
                   * lax.broadcast_in_dim(c, shape, [1]))
            o_smem[...] = acc.astype(jnp.bfloat16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows, cols])
            plgpu.wait_smem_to_gmem(0)
        pl.run_scoped(scoped, plgpu.SMEM(shape, jnp.bfloat16, transforms=out_t),
                      plgpu.SMEM((block_m,), jnp.float32), plgpu.SMEM((block_n,), jnp.float32),
                      plgpu.Barrier(num_barriers=2))

    interp = None
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interp = InterpretGPUParams()
    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((mp, n), jnp.bfloat16),
        grid=(mp // block_m, n // block_n),
        grid_names=("m", "n"),
        interpret=interp,
    )(xq, xs.reshape(mp), q, scale.reshape(n))  # the scales as vectors: TMA copies them
    return out[:m]


def w8a8_matmul(x, q, scale, *, interpret: bool = False, **blocks):
    """x [M, K] (bf16/f32) quantized per row, times q [N, K] -> [M, N] in x's dtype."""
    from .quant_reference import quantize_rows
    xq, xs = quantize_rows(x)
    return w8a8_matmul_quantized(xq, xs, q, scale, interpret=interpret, **blocks).astype(x.dtype)
