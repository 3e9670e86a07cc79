"""Flash attention forward (prefill) for Hopper, Pallas with the Mosaic GPU backend.

q [B, T, H, D], k/v [B, S, KV, D] -> [B, T, H, D], bf16 or fp16, D 64 or 128; causal masks
align the last query with the last key, as `reference.attention_reference` does.

One CTA owns 2 * block_q query rows of one head and runs three warpgroups:
- a producer that streams K/V tiles of `block_kv` keys into a ring of `num_stages` shared-memory
  slots with TMA copies, refilling a slot once both consumers have released it;
- two consumers of block_q rows each (Q in shared memory, the accumulator in registers). Each
  tile is S = Q K^T (wgmma), an online softmax in float32 (base 2, scale folded into one FMA),
  then O += P V with P straight from registers. A shared "schedule" barrier staggers the two
  consumers by half a step, so one's softmax runs while the other's matrix products hold the
  tensor cores.
Causal CTAs take the heaviest query tiles first (the grid runs from the last tile backwards) and
mask only the tiles that cross the diagonal. GQA is an index map: q head h reads kv head
h // (H // KV); the q heads of one group are neighbouring CTAs, so their K/V tiles hit L2.

Limits (callers fall back to `flash.py` otherwise): T a multiple of 2 * block_q, S of block_kv,
S >= T when causal, no segment ids.

What bounds it (H100, docs/kernels_notes.md): 69%-71% of the bf16 matrix-product rate at
S=4096, 1.04x cuDNN causal and 0.96x full. Each consumer runs its S, softmax and P V in turn;
a software-pipelined consumer (S of the next tile issued with P V of this one) measured slower
and was dropped.

In Pallas interpret mode (the CPU tests) the two matrix products run as plain dots on the shared
memory tiles, because the interpreter has no transposed or register-operand wgmma; everything
else (grid, TMA ring, barriers, masks, online softmax, stores) runs as written. The wgmma calls
and register layouts are checked only on the GPU (`tools/bench_kernels.py`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

LOG2E = math.log2(math.e)
CONSUMERS = 2  # compute warpgroups per CTA; the producer is warpgroup 2


def supported(q, k, *, causal, segment_ids=None, block_q=64, block_kv=128) -> str | None:
    """Why this kernel cannot take the call (None if it can)."""
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    if segment_ids is not None:
        return "segment ids"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
        return f"dtype {q.dtype}"
    if D not in (64, 128):
        return f"head_dim {D}"
    if H % KV:
        return f"{H} heads over {KV} kv heads"
    if T % (CONSUMERS * block_q) or S % block_kv:
        return f"T={T} or S={S} not a multiple of the tiles"
    if causal and S < T:
        return "causal with S < T"
    return None


def _kernel(q_ref, k_ref, v_ref, o_ref, scratch, *, causal, scale, block_q, block_kv,
            num_stages, group, interpret):
    (qo_smem, k_smem, v_smem), (k_full, v_full, q_full), (k_free, v_free), sched = scratch
    T, S, D = q_ref.shape[1], k_ref.shape[1], q_ref.shape[-1]
    offset = S - T  # query row r sees keys <= r + offset
    b, h, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
    tile = lax.axis_index("q_seq")
    if causal:  # heaviest tiles first
        tile = T // (CONSUMERS * block_q) - 1 - tile
    cta_rows = tile * CONSUMERS * block_q
    if causal:
        cta_steps = pl.cdiv(cta_rows + CONSUMERS * block_q + offset, block_kv)
    else:
        cta_steps = S // block_kv

    @pl.when(wg < CONSUMERS)
    def _consumer():
        if not interpret:
            plgpu.set_max_registers(232, action="increase")
        _consume(q_ref, o_ref, qo_smem.at[wg], k_smem, v_smem, k_full, v_full, q_full.at[wg],
                 k_free, v_free, sched, b=b, h=h, wg=wg, row0=cta_rows + wg * block_q,
                 cta_steps=cta_steps, offset=offset, causal=causal, scale=scale,
                 block_q=block_q, block_kv=block_kv, num_stages=num_stages, interpret=interpret)

    @pl.when(wg == CONSUMERS)
    def _producer():
        if not interpret:
            plgpu.set_max_registers(40, action="decrease")
        kv_head = h // group

        def load(src, dst, full, step, slot):
            keys = (b, pl.ds(step * block_kv, block_kv), kv_head)
            plgpu.copy_gmem_to_smem(src.at[keys], dst.at[slot], full.at[slot])

        for i in range(num_stages):
            @pl.when(i < cta_steps)
            def _():
                load(k_ref, k_smem, k_full, i, i)
                load(v_ref, v_smem, v_full, i, i)

        @pl.loop(num_stages, jnp.maximum(cta_steps, num_stages))
        def _refill(step):
            # K is released half a step before V (after S, not after P V): refill it at once.
            slot = lax.rem(step, num_stages)
            plgpu.barrier_wait(k_free.at[slot])
            load(k_ref, k_smem, k_full, step, slot)
            plgpu.barrier_wait(v_free.at[slot])
            load(v_ref, v_smem, v_full, step, slot)

        for i in range(num_stages):  # leave once the ring is empty: every release is awaited
            @pl.when(i < cta_steps)
            def _():
                plgpu.barrier_wait(k_free.at[i])
                plgpu.barrier_wait(v_free.at[i])


def _consume(q_ref, o_ref, qo_smem, k_smem, v_smem, k_full, v_full, q_full, k_free, v_free,
             sched, *, b, h, wg, row0, cta_steps, offset, causal, scale, block_q, block_kv,
             num_stages, interpret):
    D = q_ref.shape[-1]
    dtype = q_ref.dtype

    def schedule():  # meet the other consumer
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)
    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, block_q), h], qo_smem, q_full)
    plgpu.barrier_wait(q_full)
    if causal:  # key tiles [0, free) need no mask, [free, steps) cross the diagonal
        steps = pl.cdiv(row0 + block_q + offset, block_kv)
        free = (row0 + offset + 1) // block_kv
    else:
        steps = free = cta_steps

    def layout(x, lay):
        return x if interpret else plgpu.layout_cast(x, lay)

    m = layout(jnp.full((block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l = layout(jnp.full((block_q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = layout(jnp.full((block_q, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)

    pl.when(wg == 1)(schedule)  # consumer 1 starts half a step behind consumer 0

    iota = functools.partial(_iota, (block_q, block_kv), interpret=interpret)
    rows, cols = row0 + offset + iota(0), iota(1)

    def softmax(s, t, m, l, masked):
        """Online softmax of key tile t: P (in the input dtype), new max, new sum, rescale."""
        if masked:
            s = jnp.where(rows >= t * block_kv + cols, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1) * scale)
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
        return p, m_new, l * alpha + p.sum(axis=1), alpha

    acc, l = _staggered_loop(softmax, acc, m, l, qo_smem=qo_smem, k_smem=k_smem, v_smem=v_smem,
                             k_full=k_full, v_full=v_full, k_free=k_free, v_free=v_free,
                             schedule=schedule, sched=sched, steps=steps, free=free,
                             num_stages=num_stages, block_q=block_q, block_kv=block_kv,
                             dtype=dtype, causal=causal, interpret=interpret)

    @pl.loop(steps, cta_steps)
    def _drain(j):  # tiles only the other consumer needs: release them, keep the stagger
        slot = lax.rem(j, num_stages)
        for full, free in ((k_full, k_free), (v_full, v_free)):
            plgpu.barrier_wait(full.at[slot])  # keeps this thread's barrier phases in step
            plgpu.barrier_arrive(free.at[slot])
        schedule()
        schedule()

    pl.when(wg == 0)(schedule)
    acc = acc / lax.broadcast_in_dim(l, acc.shape, [0])
    qo_smem[...] = acc.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[b, pl.ds(row0, block_q), h])
    plgpu.wait_smem_to_gmem(0)


def _staggered_loop(softmax, acc, m, l, *, qo_smem, k_smem, v_smem, k_full, v_full, k_free,
                    v_free, schedule, sched, steps, free, num_stages, block_q, block_kv, dtype,
                    causal, interpret):
    """One tile per step: S = Q K^T, softmax, O += P V, the two consumers half a step apart
    so that one's softmax overlaps the other's matrix products."""
    def step(j, carry, masked):
        acc, m, l = carry
        slot = lax.rem(j, num_stages)
        s = _qk(qo_smem, k_smem.at[slot], schedule, block_q, block_kv, interpret)
        plgpu.barrier_arrive(k_free.at[slot])
        p, m_new, l, alpha = softmax(s, j, m, l, masked)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        p = p.astype(dtype)
        acc, l, m_new, p = lax.optimization_barrier((acc, l, m_new, p))
        plgpu.barrier_arrive(sched)  # softmax done
        plgpu.barrier_wait(v_full.at[slot])
        plgpu.barrier_wait(sched)  # tensor cores free
        nxt = j + 1
        wait_next = lambda: pl.when(nxt < steps)(
            lambda: plgpu.barrier_wait(k_full.at[lax.rem(nxt, num_stages)]))
        acc = _pv(acc, p, v_smem.at[slot], wait_next, interpret)
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l

    @pl.when(steps > 0)
    def _():
        plgpu.barrier_wait(k_full.at[0])

    carry = lax.fori_loop(0, free, functools.partial(step, masked=False), (acc, m, l))
    acc, m, l = lax.fori_loop(free, steps, functools.partial(step, masked=causal), carry)
    return acc, l


def _iota(shape, dim, *, interpret):
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _qk(q_smem, k_tile, schedule, block_q, block_kv, interpret):
    """S = Q K^T in float32; the schedule barrier sits between issuing and reading it."""
    if interpret:
        s = jnp.dot(q_smem[...].astype(jnp.float32), k_tile[...].astype(jnp.float32).T)
        schedule()
        return s

    def body(acc):
        plgpu.wgmma(acc, q_smem, plgpu.transpose_ref(k_tile, (1, 0)))
        schedule()
        return acc[...]
    return pl.run_scoped(body, plgpu.ACC((block_q, block_kv), jnp.float32))


def _pv(acc, p, v_tile, wait_next, interpret):
    """acc += P V, P from registers; `wait_next` runs while the product is in flight."""
    if interpret:
        acc = acc + jnp.dot(p.astype(jnp.float32), v_tile[...].astype(jnp.float32))
        wait_next()
        return acc

    def body(acc_ref):
        plgpu.wgmma(acc_ref, p, v_tile)
        wait_next()
    return pl.run_state(body)(plgpu.ACC.init(acc))


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "block_q", "block_kv",
                                             "num_stages", "interpret"))
def flash_attention(q, k, v, *, causal=True, sm_scale=None, block_q=64, block_kv=128,
                    num_stages=2, interpret=False):
    why = supported(q, k, causal=causal, block_q=block_q, block_kv=block_kv)
    if why:
        raise ValueError(f"flash_mgpu cannot take this call: {why}")
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    num_stages = max(1, min(num_stages, S // block_kv))
    scale = (D ** -0.5 if sm_scale is None else sm_scale) * LOG2E
    smem = functools.partial(plgpu.SMEM, dtype=q.dtype, transforms=(
        plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    scratch = [
        (smem((CONSUMERS, block_q, D)), smem((num_stages, block_kv, D)),
         smem((num_stages, block_kv, D))),
        (plgpu.Barrier(num_barriers=num_stages), plgpu.Barrier(num_barriers=num_stages),
         plgpu.Barrier(num_barriers=CONSUMERS)),
        (plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=num_stages),) * 2,
        plgpu.Barrier(num_arrivals=CONSUMERS),
    ]
    body = functools.partial(_kernel, causal=causal, scale=scale, block_q=block_q,
                             block_kv=block_kv, num_stages=num_stages, group=H // KV,
                             interpret=interpret)

    def entry(q_ref, k_ref, v_ref, o_ref):
        pl.run_scoped(lambda *s: body(q_ref, k_ref, v_ref, o_ref, s), *scratch,
                      collective_axes="wg")

    interp = interpret or None
    if interpret is True:  # or an InterpretGPUParams, e.g. with detect_races=True
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interp = InterpretGPUParams()
    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(H, T // (CONSUMERS * block_q), B),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interp,
    )(q, k, v)
