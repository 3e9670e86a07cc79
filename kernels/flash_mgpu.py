"""Flash attention forward (prefill) for Hopper, Pallas with the Mosaic GPU backend.

q [B, T, H, D], k/v [B, S, KV, D] -> [B, T, H, D], bf16 or fp16, D 64 or 128; causal masks
align the last query with the last key, as `reference.attention_reference` does.

The grid is persistent: one CTA per SM (`num_ctas`) loops over (batch, head, query tile) work
items, heaviest causal tiles first and in snake order over rounds so that the CTAs' loads even
out. Each work item is 2 * block_q query rows of one head, run by three warpgroups:
- a producer that streams K/V tiles of `block_kv` keys into a ring of `num_stages` shared-memory
  slots with TMA copies, refilling a slot once both consumers have released it. The ring runs on
  across work items, so the next item's first tiles load while the consumers finish this one;
- two consumers of block_q rows each (Q in shared memory, the accumulator in registers). Each
  tile is S = Q K^T (wgmma), an online softmax in float32 (base 2, scale folded into one FMA),
  then O += P V with P straight from registers. A shared "schedule" barrier staggers the two
  consumers by half a step, so one's softmax runs while the other's matrix products hold the
  tensor cores. The next item's Q is copied in as soon as the last Q K^T has read the old one,
  and the output leaves through its own shared-memory buffer without being waited for.
Only the key tiles that cross the diagonal are masked. GQA is an index map: q head h reads kv
head h // (H // KV); the q heads of one group are neighbouring work items, so their K/V tiles
hit L2.

Limits (callers fall back to `flash.py` otherwise): T a multiple of 2 * block_q, S of block_kv,
S >= T when causal, no segment ids.

What bounds it (H100, docs/kernels_notes.md): at S=4096 it runs 655-663 TFLOP/s (causal
counted as half the full product), 66%-67% of the 989 TFLOP/s bf16 tensor-core peak (a large
matrix product reaches 798): 1.12x cuDNN causal, device-timed, and 0.97x-0.98x full. A
work item's 128-key step takes ~1.7 us against 1.12 us of tensor-core work at peak. The softmax
is why (`profiling/profile_flash.py`, `profiling/ncu_flash.py`): a thread's 64 exp2 issue as one run of
MUFU.EX2 (16 results per clock and SM: 512 cycles a warp), the O rescale and P's conversion
wait behind it in issue order, and with the two consumers taking turns their softmaxes
alternate, so a step lasts about two softmaxes while the tensor cores idle. P's row sums run
under P V (`late_sum`, 1.6% faster); tree reductions, exp2 on the FMA pipes for half the columns
and free-running consumers measured slower.
`overlap=True` takes the softmax off the tensor cores' path as FlashAttention-3 does: a
consumer issues S(j) and P(j-1) V(j-1) in one turn and runs tile j's softmax while P V is in
flight (the diagonal tiles excepted, see `wgmma_qk_pv`); the two consumers hand the tensor
cores to each other through a pair of turn barriers, so their issue phases alternate. Measured
on the H100 it is no faster (1.044 vs 0.967 ms causal, 1.992 vs 1.984 full, same run), so it
stays off.

In Pallas interpret mode (the CPU tests) the two matrix products run as plain dots on the shared
memory tiles, because the interpreter has no transposed or register-operand wgmma; everything
else (grid, TMA ring, barriers, masks, online softmax, stores) runs as written. The wgmma calls
and register layouts are checked only on the GPU (`benchmarks/bench_kernels.py`).
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
    if T % (CONSUMERS * block_q) or S % block_kv or not S:  # every work item has a key tile
        return f"T={T} or S={S} not a positive multiple of the tiles"
    if causal and S < T:
        return "causal with S < T"
    return None


def _tiles(T, H, B, block_q, causal, num_ctas, band):
    """Work list of one CTA: its i-th tile, in snake order over rounds of `num_ctas` tiles so
    that the heaviest causal tiles go first and the load evens out. The heads run in bands of
    `band` query heads (whole GQA groups), one band after the other, so that the K/V the CTAs
    read at one time stays within L2. Returns `locate(cta, i)` -> (valid, b, h, q tile) and the
    number of rounds."""
    q_tiles = T // (CONSUMERS * block_q)
    total, per_band = q_tiles * H * B, q_tiles * band * B

    def locate(cta, i):
        w = i * num_ctas + jnp.where(lax.rem(i, 2) == 0, cta, num_ctas - 1 - cta)
        first, w_in = lax.div(w, per_band) * band, lax.rem(w, per_band)
        level, r = lax.div(w_in, band * B), lax.rem(w_in, band * B)
        tile = q_tiles - 1 - level if causal else level
        return w < total, lax.div(r, band), first + lax.rem(r, band), tile

    return locate, pl.cdiv(total, num_ctas)


# K/V a band of full (non-causal) attention may read at once. Measured on the H100 at 16k
# tokens (benchmarks/sweep_flash_band.py): full attention runs 690 TFLOP/s in bands of 16 MB
# against 672 with every head at once; causal runs best with every head at once (691 against
# 679 in 32 MB bands and 585 in 8 MB), its CTAs spread over key ranges of every length anyway.
L2_KV_BYTES = 16 << 20


def band_kv_heads(B, S, KV, D, itemsize, causal=False, budget=L2_KV_BYTES) -> int:
    """The most KV heads (a divisor of KV) whose K/V over the batch fits `budget`; every head
    for causal attention."""
    per_head = 2 * B * S * D * itemsize
    if causal:
        return KV
    return max([n for n in range(1, KV + 1) if KV % n == 0 and n * per_head <= budget] or [1])


def _kernel(q_ref, k_ref, v_ref, o_ref, scratch, *, causal, scale, block_q, block_kv,
            num_stages, group, num_ctas, band, overlap, late_sum, interpret):
    (q_smem, o_smem, k_smem, v_smem), (k_full, v_full, q_full), (k_free, v_free), \
        (sched, turn) = scratch
    B, T, H, _ = q_ref.shape
    S = k_ref.shape[1]
    offset = S - T  # query row r sees keys <= r + offset
    cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
    locate, rounds = _tiles(T, H, B, block_q, causal, num_ctas, band)

    def cta_steps(tile):  # key tiles the CTA's 2 * block_q rows need
        if causal:
            return pl.cdiv((tile + 1) * CONSUMERS * block_q + offset, block_kv)
        return S // block_kv

    @pl.when(wg < CONSUMERS)
    def _consumer():
        if not interpret:
            plgpu.set_max_registers(232, action="increase")
        consume = functools.partial(
            _consume, q_ref, o_ref, q_smem.at[wg], o_smem.at[wg], k_smem, v_smem, k_full,
            v_full, q_full.at[wg], k_free, v_free, sched, turn, wg=wg, offset=offset,
            causal=causal, scale=scale, block_q=block_q, block_kv=block_kv,
            num_stages=num_stages, overlap=overlap, late_sum=late_sum,
            interpret=interpret)
        load_q = lambda b, h, tile: plgpu.copy_gmem_to_smem(
            q_ref.at[b, pl.ds((tile * CONSUMERS + wg) * block_q, block_q), h], q_smem.at[wg],
            q_full.at[wg])
        valid, b, h, tile = locate(cta, 0)
        pl.when(valid)(lambda: load_q(b, h, tile))
        if overlap:  # consumer 0 issues first: its first turn is a gift from consumer 1
            pl.when(wg == 1)(lambda: plgpu.barrier_arrive(turn.at[0]))

        @pl.loop(0, rounds, init_carry=jnp.int32(0))
        def _tile(i, g):  # g: the ring position of this tile's first key tile
            valid, b, h, tile = locate(cta, i)
            steps = cta_steps(tile)
            nxt = locate(cta, i + 1)
            prefetch_q = lambda: pl.when(nxt[0])(lambda: load_q(*nxt[1:]))
            pl.when(valid)(lambda: consume(b=b, h=h, tile=tile, g=g, cta_steps=steps,
                                           prefetch_q=prefetch_q))
            return g + jnp.where(valid, steps, 0)
        if overlap:  # the turn consumer 1 passed last is never taken: observe it
            pl.when(wg == 0)(lambda: plgpu.barrier_wait(turn.at[0]))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
        if not interpret:
            plgpu.set_max_registers(40, action="decrease")

        def load(src, dst, full, free, b, h, step, g):
            slot = lax.rem(g, num_stages)
            pl.when(g >= num_stages)(lambda: plgpu.barrier_wait(free.at[slot]))
            keys = (b, pl.ds(step * block_kv, block_kv), h // group)
            plgpu.copy_gmem_to_smem(src.at[keys], dst.at[slot], full.at[slot])

        @pl.loop(0, rounds, init_carry=jnp.int32(0))
        def g_end(i, g):
            valid, b, h, tile = locate(cta, i)
            steps = jnp.where(valid, cta_steps(tile), 0)

            @pl.loop(0, steps)
            def _step(j):  # K is released half a step before V: refill it at once
                load(k_ref, k_smem, k_full, k_free, b, h, j, g + j)
                load(v_ref, v_smem, v_full, v_free, b, h, j, g + j)
            return g + steps

        for i in range(num_stages):  # leave once the ring is empty: every release is awaited
            g = g_end - num_stages + i

            @pl.when(g >= 0)
            def _():
                plgpu.barrier_wait(k_free.at[lax.rem(g, num_stages)])
                plgpu.barrier_wait(v_free.at[lax.rem(g, num_stages)])


def _consume(q_ref, o_ref, q_smem, o_smem, k_smem, v_smem, k_full, v_full, q_full, k_free,
             v_free, sched, turn, *, b, h, tile, g, cta_steps, prefetch_q, wg, offset, causal,
             scale, block_q, block_kv, num_stages, overlap, late_sum, interpret):
    """One consumer's block_q rows of one tile: the key loop, then the output through o_smem."""
    D = q_ref.shape[-1]
    dtype = q_ref.dtype
    row0 = (tile * CONSUMERS + wg) * block_q

    def schedule():  # meet the other consumer
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)
    with jax.named_scope("wait_q"):
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

    if not overlap:
        pl.when(wg == 1)(schedule)  # consumer 1 starts half a step behind consumer 0

    def softmax(s, t, m, l, masked):
        """Online softmax of key tile t: P (float32), new max, new sum (None with `late_sum`:
        the caller adds P's row sums itself), rescale."""
        if masked:  # the iotas are built here, not held in registers across the key loop
            iota = functools.partial(wgmma_iota, s.shape, interpret=interpret)
            s = jnp.where(iota(0) + (row0 + offset - t * block_kv) >= iota(1), s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1) * scale)
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
        return p, m_new, None if late_sum else l * alpha + p.sum(axis=1), alpha

    slot = lambda j: lax.rem(g + j, num_stages)
    ring = dict(q_smem=q_smem, k_smem=k_smem, v_smem=v_smem, k_full=k_full, v_full=v_full,
                k_free=k_free, v_free=v_free, slot=slot, steps=steps, free=free, dtype=dtype,
                causal=causal, interpret=interpret)
    if overlap:
        take = lambda: plgpu.barrier_wait(turn.at[wg])  # the tensor cores are this one's
        give = lambda: plgpu.barrier_arrive(turn.at[1 - wg])
        acc, l = _overlapped_loop(softmax, acc, m, l, take=take, give=give, **ring)
        prefetch_q()  # the last Q K^T has read q_smem: the next tile's rows can land there
    else:
        # A causal diagonal tile of which this consumer needs only the first half of the keys
        # (consumer 0's, when block_kv = 2 * block_q) runs as a half tile.
        tail = row0 + block_q + offset - (steps - 1) * block_kv  # keys of the last tile used
        half_last = (steps > free) & (tail <= block_kv // 2) if causal and block_kv >= 128 \
            else False
        acc, l = _staggered_loop(softmax, acc, m, l, schedule=schedule, sched=sched,
                                 late_sum=late_sum, prefetch_q=prefetch_q, half_last=half_last,
                                 **ring)

    @pl.loop(steps, cta_steps)
    def _drain(j):  # tiles only the other consumer needs: release them, keep the stagger
        for full, free in ((k_full, k_free), (v_full, v_free)):
            plgpu.barrier_wait(full.at[slot(j)])  # keeps this thread's barrier phases in step
            plgpu.barrier_arrive(free.at[slot(j)])
        if overlap:  # one turn per tile, as the other consumer takes
            take()
            give()
        else:
            schedule()
            schedule()

    if not overlap:
        pl.when(wg == 0)(schedule)
    with jax.named_scope("epilogue"):
        acc = acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])  # a division per row
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store left o_smem
        o_smem[...] = acc.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, pl.ds(row0, block_q), h])


def _staggered_loop(softmax, acc, m, l, *, q_smem, k_smem, v_smem, k_full, v_full, k_free,
                    v_free, schedule, sched, slot, steps, free, dtype, causal, late_sum,
                    prefetch_q, half_last, interpret):
    """One tile per step: S = Q K^T, softmax, O += P V, the two consumers half a step apart
    so that one's softmax overlaps the other's matrix products. `late_sum` adds P's row sums
    to l while P V runs, off the path to the tensor cores. `prefetch_q` loads the next work
    item's Q as soon as the last Q K^T has landed, so it has that step's softmax and P V to
    arrive in. `half_last` (traced): the last tile runs on its first half of keys."""
    def step(j, carry, masked, keys=None):  # the scopes name the phases in a profile
        acc, m, l = carry
        k_tile, v_tile = k_smem.at[slot(j)], v_smem.at[slot(j)]
        if keys is not None:  # the keys past these are masked for every row
            k_tile, v_tile = k_tile.at[pl.ds(0, keys)], v_tile.at[pl.ds(0, keys)]
        with jax.named_scope("qk"):
            s = wgmma_qk(q_smem, k_tile, interpret, between=schedule)
        pl.when(j == steps - 1)(prefetch_q)  # q_smem is read: the next item's Q can land
        plgpu.barrier_arrive(k_free.at[slot(j)])
        with jax.named_scope("softmax"):
            p32, m_new, l_new, alpha = softmax(s, j, m, l, masked)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p = p32.astype(dtype)
            if late_sum:  # P's row sums are taken while P V runs (below)
                acc, m_new, p, p32, alpha = lax.optimization_barrier((acc, m_new, p, p32, alpha))
            else:
                acc, l, m_new, p = lax.optimization_barrier((acc, l_new, m_new, p))
        with jax.named_scope("wait_tc"):
            plgpu.barrier_arrive(sched)  # softmax done
            plgpu.barrier_wait(v_full.at[slot(j)])
            plgpu.barrier_wait(sched)  # tensor cores free
        wait_next = lambda: pl.when(j + 1 < steps)(
            lambda: plgpu.barrier_wait(k_full.at[slot(j + 1)]))
        with jax.named_scope("pv"):
            if late_sum:
                acc, l = wgmma_pv(acc, p, v_tile, wait_next, interpret, during=(
                    lambda: l * alpha + p32.sum(axis=1), l))
            else:
                acc = wgmma_pv(acc, p, v_tile, wait_next, interpret)
        plgpu.barrier_arrive(v_free.at[slot(j)])
        return acc, m_new, l

    @pl.when(steps > 0)
    def _():
        plgpu.barrier_wait(k_full.at[slot(0)])

    carry = lax.fori_loop(0, free, functools.partial(step, masked=False), (acc, m, l))
    n_full = steps - jnp.asarray(half_last).astype(jnp.int32)
    carry = lax.fori_loop(free, n_full, functools.partial(step, masked=causal), carry)
    if half_last is not False:
        half = functools.partial(step, steps - 1, masked=True, keys=k_smem.shape[1] // 2)
        carry = lax.cond(half_last, half, lambda c: c, carry)
    acc, m, l = carry
    return acc, l


def _overlapped_loop(softmax, acc, m, l, *, take, give, q_smem, k_smem, v_smem, k_full, v_full,
                     k_free, v_free, slot, steps, free, dtype, causal, interpret):
    """Software-pipelined consumer: step j issues S(j) = Q K(j)^T and O += P(j-1) V(j-1)
    together in its turn on the tensor cores, then runs tile j's softmax while P V is still in
    flight and rescales O once it lands. The two consumers take turns (`take`/`give`), so one
    issues while the other runs its softmax."""
    with jax.named_scope("qk"):  # tile 0 alone: masked when causal (exact on any tile)
        plgpu.barrier_wait(k_full.at[slot(0)])
        take()
        s = wgmma_qk(q_smem, k_smem.at[slot(0)], interpret, between=give)
    plgpu.barrier_arrive(k_free.at[slot(0)])
    with jax.named_scope("softmax"):
        p, m, l, _ = softmax(s, 0, m, l, masked=causal)
        p = p.astype(dtype)

    def step(j, carry, masked):
        acc, p, m, l = carry
        with jax.named_scope("wait_kv"):
            plgpu.barrier_wait(k_full.at[slot(j)])
            plgpu.barrier_wait(v_full.at[slot(j - 1)])

        def softmax_j(s):  # runs while P(j-1) V(j-1) is on the tensor cores
            plgpu.barrier_arrive(k_free.at[slot(j)])
            p_new, m_new, l_new, alpha = softmax(s, j, m, l, masked)
            return p_new.astype(dtype), m_new, l_new, alpha
        with jax.named_scope("qk_pv_softmax"):
            acc, (p_new, m_new, l_new, alpha) = wgmma_qk_pv(
                acc, p, q_smem, k_smem.at[slot(j)], v_smem.at[slot(j - 1)], take, give,
                softmax_j, (p, m, l, m), interpret, overlap_then=not masked)
        plgpu.barrier_arrive(v_free.at[slot(j - 1)])
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), p_new, m_new, l_new

    mid = jnp.clip(free, 1, steps)
    carry = lax.fori_loop(1, mid, functools.partial(step, masked=False), (acc, p, m, l))
    acc, p, m, l = lax.fori_loop(mid, steps, functools.partial(step, masked=causal), carry)
    with jax.named_scope("pv"):  # the last tile's P V
        last = slot(steps - 1)
        plgpu.barrier_wait(v_full.at[last])
        take()
        acc = wgmma_pv(acc, p, v_smem.at[last], give, interpret)
    plgpu.barrier_arrive(v_free.at[last])
    return acc, l


def wgmma_iota(shape, dim, *, interpret):
    """An iota in the layout of a wgmma accumulator (a plain one in interpret mode)."""
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def wgmma_qk(q_smem, k_tile, interpret, between=None):
    """S = Q K^T in float32 from two shared-memory tiles; `between` runs after the product is
    issued and before it is read (the flash consumers meet there)."""
    between = between or (lambda: None)
    if interpret:
        s = jnp.dot(q_smem[...].astype(jnp.float32), k_tile[...].astype(jnp.float32).T)
        between()
        return s

    def body(acc):
        plgpu.wgmma(acc, q_smem, plgpu.transpose_ref(k_tile, (1, 0)))
        between()
        return acc[...]
    return pl.run_scoped(body, plgpu.ACC((q_smem.shape[0], k_tile.shape[0]), jnp.float32))


def wgmma_pv(acc, p, v_tile, wait_next, interpret, during=None):
    """acc += P V, P from registers; `wait_next` runs while the product is in flight. With
    `during` = (f, like), f() runs then too and (acc, its result shaped as `like`) returns."""
    if interpret:
        acc = acc + jnp.dot(p.astype(jnp.float32), v_tile[...].astype(jnp.float32))
        out = during and during[0]()
        wait_next()
        return (acc, out) if during else acc

    def body(acc_ref, out_ref=None):
        plgpu.wgmma(acc_ref, p, v_tile)
        if during:
            out_ref[...] = during[0]()
        wait_next()
    if during is None:
        return pl.run_state(body)(plgpu.ACC.init(acc))
    return pl.run_state(lambda refs: body(*refs))((plgpu.ACC.init(acc), during[1]))


def _profile_params(profile_dir):
    if not profile_dir:
        return {}
    # The event buffer lives in shared memory next to the K/V ring: room for ~60 steps.
    return dict(profile_space=512, profile_dir=profile_dir, profile_bounds_check=True)


def sm_count() -> int:
    """Streaming multiprocessors of the first device (132 on an H100 SXM)."""
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or 132
    except Exception:
        return 132


def wgmma_qk_pv(acc, p, q_smem, k_tile, v_tile, before, after_issue, then, like, interpret,
                overlap_then=True):
    """Issue S = Q K^T and O = acc + P V back to back between `before` and `after_issue`, then
    `then(S)` as soon as S has landed while P V may still run (or, with `overlap_then=False`,
    once both have landed). Returns (O, what `then` returned, shaped as `like`)."""
    if interpret:
        before()
        s = jnp.dot(q_smem[...].astype(jnp.float32), k_tile[...].astype(jnp.float32).T)
        acc = acc + jnp.dot(p.astype(jnp.float32), v_tile[...].astype(jnp.float32))
        after_issue()
        return acc, then(s)

    def body(refs):
        o_ref, out_refs = refs

        def with_s(s_ref):
            before()
            plgpu.wgmma(s_ref, q_smem, plgpu.transpose_ref(k_tile, (1, 0)))
            plgpu.wgmma(o_ref, p, v_tile)  # its own commit group: S can be awaited alone
            after_issue()
            # A masked (diagonal) softmax under an in-flight P V made ptxas serialize every
            # wgmma of the kernel (warning C7513; 1.41 vs 1.00 ms causal on the H100): the
            # diagonal tiles wait for P V first, and the warning is gone.
            return then(plgpu.wgmma_accumulator_load(s_ref, wait_n=1 if overlap_then else 0))
        out = pl.run_scoped(with_s, plgpu.ACC((q_smem.shape[0], k_tile.shape[0]), jnp.float32))
        for r, x in zip(out_refs, out):
            r[...] = x
    return pl.run_state(body)((plgpu.ACC.init(acc), like))


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "block_q", "block_kv",
                                             "num_stages", "num_ctas", "band_kv", "overlap",
                                             "late_sum", "profile_dir", "interpret"))
def flash_attention(q, k, v, *, causal=True, sm_scale=None, block_q=64, block_kv=128,
                    num_stages=2, num_ctas=None, band_kv=None, overlap=False, late_sum=True,
                    profile_dir=None, interpret=False):
    """`num_ctas` persistent CTAs (None: one per SM) loop over the query tiles; with as many
    CTAs as tiles each runs one, as a plain grid would. `profile_dir` (GPU) writes a trace of
    each warpgroup's named phases there (`profiling/profile_flash.py` reads it). `overlap`
    software-pipelines each consumer (`_overlapped_loop`); measured no faster on the H100, off.
    `late_sum` (staggered loop) takes P's row sums while P V runs: 1.6% faster causal.
    `band_kv`: KV heads whose work runs together (None: `band_kv_heads`)."""
    why = supported(q, k, causal=causal, block_q=block_q, block_kv=block_kv)
    if why:
        raise ValueError(f"flash_mgpu cannot take this call: {why}")
    late_sum = late_sum and not overlap  # the pipelined loop sums P in its softmax
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    num_stages = max(1, min(num_stages, S // block_kv))
    tiles = B * H * T // (CONSUMERS * block_q)
    num_ctas = min(num_ctas or sm_count(), tiles)
    band_kv = band_kv or band_kv_heads(B, S, KV, D, q.dtype.itemsize, causal)
    if KV % band_kv:
        raise ValueError(f"band_kv={band_kv} must divide the {KV} KV heads")
    scale = (D ** -0.5 if sm_scale is None else sm_scale) * LOG2E
    smem = functools.partial(plgpu.SMEM, dtype=q.dtype, transforms=(
        plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    scratch = [
        (smem((CONSUMERS, block_q, D)), smem((CONSUMERS, block_q, D)),
         smem((num_stages, block_kv, D)), smem((num_stages, block_kv, D))),
        (plgpu.Barrier(num_barriers=num_stages), plgpu.Barrier(num_barriers=num_stages),
         plgpu.Barrier(num_barriers=CONSUMERS)),
        (plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=num_stages),) * 2,
        (plgpu.Barrier(num_arrivals=CONSUMERS), plgpu.Barrier(num_barriers=CONSUMERS)),
    ]
    body = functools.partial(_kernel, causal=causal, scale=scale, block_q=block_q,
                             block_kv=block_kv, num_stages=num_stages, group=H // KV,
                             num_ctas=num_ctas, band=band_kv * (H // KV), overlap=overlap,
                             late_sum=late_sum, interpret=interpret)

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
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, **_profile_params(profile_dir)),
        interpret=interp,
    )(q, k, v)
