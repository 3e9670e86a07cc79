"""Paged attention for Hopper, Pallas with the Mosaic GPU backend: decode, and mixed steps of
prefill chunks and decode tokens.

Decode: q [S, H, D] (one token per sequence), k/v_pages [KV, P, page_size, D], context_lens [S],
page_table [S, pages_per_seq] -> [S, H, D]; bf16 or fp16 with float32 softmax and accumulation;
the same results as `reference.paged_attention_reference`. Mixed (`ragged_paged_attention`): q
[T, H, D] on one flat token axis cut by query_start, as `reference.ragged_paged_attention_reference`;
a CTA's block is then up to 64 // G query tokens of one sequence (blocks as `paged.block_metadata`
cuts them), its rows token-major, each row masked at its own token's causal limit. Decode is the
case of one token a block.

One CTA per (block, kv head, split) runs two warpgroups:
- a producer that streams the split's key tiles (`block_k` keys each) into a ring of
  `num_stages` shared-memory slots for K and for V: one TMA copy per page (or per `block_k`
  rows of a page larger than the tile), the page id read from the page table in global memory.
  A slot's "full" barrier expects one arrival per copy, so it completes when the whole tile has
  landed; a slot is refilled once the consumer released it (K right after S, V after P V);
- a consumer whose 64 rows are the G = H // KV query heads of the kv head (q is packed to
  [S, KV, 64, D] outside, zero rows past G; for mixed steps, the block's tokens times their G
  heads), so each K/V page is read once for the whole group.
  Each tile is S = Q K^T (wgmma), an online softmax in float32 (base 2, scale folded in), then
  O += P V with P straight from registers.
Persistent CTAs (`programs`): that many CTAs a split instead of one a (block, kv head) item,
each taking every programs-th item (blocks fastest, so the CTAs running at once read one kv
head's pages). The producer streams the items' tiles through one ring, the ring's step counted
on across items, so the next item's first tiles land while the consumer finishes the last
one's; q has two slots, the next item's copied in while this one runs. Short tables leave a
CTA a few tiles, and its setup and drain then weigh as much as its reads.
Split-K: a split takes an even share of the sequence's key tiles and writes a normalized float32
output and its base-2 log-sum-exp, merged by `paged.merge_splits` (which also drops the padding
rows); a split with no tiles writes zeros and NEG_INF. With one split the kernel writes the
output in q's dtype. Outputs keep only the group's rows, rounded up to 8 (the shared-memory
tile), not all 64.

Keys at or past context_lens[s] contribute nothing whatever the pool holds there (stale or NaN
slots): table entries past the sequence's last page are never read (those copies fetch the last
page again), scores of such keys are -inf, and on the one tile that crosses context_lens[s] the
consumer zeroes the V rows past it in shared memory before P V, so 0 * NaN cannot reach O.

Limits (`supported`): bf16/fp16 q and pages (not float8 pages, whose V is keys-last, which
this kernel does not read), head_dim 64 or 128, G <= 64, block_k a multiple of 64, page_size a
multiple of 8 that divides block_k or is a multiple of it, the rings within shared memory.
Context lengths past pages_per_seq * page_size are clamped to it.

In Pallas interpret mode (the CPU tests) the two matrix products run as plain dots on the shared
memory tiles, because the interpreter has no transposed or register-operand wgmma; everything
else (grid, page-table reads, TMA ring, barriers, masks, V zeroing, online softmax, stores) runs
as written. The wgmma calls and register layouts are checked only on the GPU.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .flash_mgpu import wgmma_iota, wgmma_pv, wgmma_qk
from .paged import block_metadata, merge_splits
from .reference import NEG_INF

LOG2E = math.log2(math.e)
ROWS = 64  # query rows per CTA: the wgmma M; a kv head's G query heads, zero-padded
SMEM_BYTES = 227 * 1024  # shared memory one Hopper CTA may use


def _smem_bytes(D, itemsize, block_k, num_stages, num_splits, programs=None):
    ring = 2 * num_stages * block_k * D * itemsize
    q = ROWS * D * itemsize * (1 if programs is None else 2)
    out = ROWS * D * 4 + ROWS * 4 if num_splits > 1 else 0
    return ring + q + out


def supported(q, k_pages, *, block_k=64, num_stages=4, num_splits=1, programs=None,
              **_) -> str | None:
    """Why this kernel cannot take the call (None if it can)."""
    S, H, D = q.shape
    KV, _, page_size, Dk = k_pages.shape
    if k_pages.dtype == jnp.float8_e4m3fn:
        return ("float8 pages: V is keys-last ([KV, P, D, page_size]), which this kernel does "
                "not read; the Triton kernel takes them")
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_pages.dtype != q.dtype:
        return f"dtype {q.dtype} (k/v {k_pages.dtype})"
    if D not in (64, 128) or Dk != D:
        return f"head_dim {D}"
    if H % KV:
        return f"{H} heads over {KV} kv heads"
    if H // KV > ROWS:
        return f"group of {H // KV} query heads per kv head (at most {ROWS})"
    if block_k % 64:
        return f"block_k {block_k} not a multiple of 64"
    if page_size % 8 or (block_k % page_size and page_size % block_k):
        return f"page_size {page_size} (a multiple of 8 dividing block_k or a multiple of it)"
    if num_splits < 1 or num_stages < 1:
        return f"num_splits {num_splits}, num_stages {num_stages}"
    if programs is not None and programs < 1:
        return f"programs {programs}"
    need = _smem_bytes(D, 2, block_k, num_stages, num_splits, programs)
    if need > SMEM_BYTES:
        return f"{need} bytes of shared memory (block_k or num_stages too large)"
    return None


def _split_tiles(ctx, split, *, block_k, num_splits):
    """Key tiles [lo, hi) of this split: an even share of the sequence's tiles."""
    n_tiles = pl.cdiv(ctx, block_k)
    share = pl.cdiv(n_tiles, num_splits)
    lo = jnp.minimum(split * share, n_tiles)
    return lo, jnp.minimum(lo + share, n_tiles)


class Item(NamedTuple):
    """One (block, kv head) of a CTA: its sequence, the keys its last token sees, its tokens,
    and the split's key tiles [lo, hi)."""
    b: jax.Array
    kv: jax.Array
    s: jax.Array
    ctx: jax.Array
    n: jax.Array
    lo: jax.Array
    hi: jax.Array


def _items(ctx_ref, *, num_kv, num_blocks, programs, split, max_keys, ragged, block_k,
           num_splits):
    """This CTA's items and their count: item i is (block, kv head) number p + i * programs,
    blocks fastest, so CTAs that run at once read one kv head's pages, which a sequence's
    chunk blocks then share through the L2 (one item a CTA when `programs` is None). Items
    past the last have no tiles."""
    p, total = lax.axis_index("item"), num_blocks * num_kv
    count = 1 if programs is None else lax.div(total - p + programs - 1, programs)

    def item(i):
        k = p + i * (programs or 0)
        real = k < total
        k = jnp.minimum(k, total - 1)
        kv, b = lax.div(k, num_blocks), lax.rem(k, num_blocks)
        if ragged:  # query tokens of one sequence: (sequence, keys the last one sees, tokens)
            s, ctx, n = ctx_ref[0, b], ctx_ref[1, b], ctx_ref[2, b]
        else:  # decode: block b is sequence b's one token
            s, ctx, n = b, ctx_ref[b], 1
        ctx = jnp.where(real, jnp.minimum(ctx, max_keys), 0)  # within the table
        lo, hi = _split_tiles(ctx, split, block_k=block_k, num_splits=num_splits)
        return Item(b, kv, s, ctx, n, lo, hi)
    return item, count


def _each(count, body):
    """body(i, steps) over a CTA's items, steps being the key tiles of the items before it;
    returns all their tiles. No loop for one item (and no array closed over by its loops: the
    Mosaic GPU lowering takes no constant operand there)."""
    if isinstance(count, int) and count == 1:
        return body(0, 0)
    return lax.fori_loop(0, count, body, jnp.int32(0))


def _kernel(ctx_ref, pt_ref, q_ref, k_ref, v_ref, *refs, scale, block_k, num_stages,
            num_splits, group, ragged, programs, interpret):
    out_refs, scratch = refs[:-1], refs[-1]
    split = lax.axis_index("split")
    item, count = _items(ctx_ref, num_kv=k_ref.shape[0], num_blocks=q_ref.shape[0],
                         programs=programs, split=split,
                         max_keys=pt_ref.shape[1] * k_ref.shape[2], ragged=ragged,
                         block_k=block_k, num_splits=num_splits)
    wg = lax.axis_index("wg")
    smem, (k_full, v_full, q_full), (k_free, v_free) = scratch
    q_smem, k_smem, v_smem, o_smem = smem
    ring = dict(k_smem=k_smem, v_smem=v_smem, k_full=k_full, v_full=v_full, k_free=k_free,
                v_free=v_free, block_k=block_k, num_stages=num_stages)

    @pl.when(wg == 0)
    def _consumer():
        _consume(q_ref, out_refs, q_smem, o_smem, q_full, item=item, count=count, split=split,
                 group=group, ragged=ragged, scale=scale, interpret=interpret, **ring)

    pl.when(wg == 1)(lambda: _produce(pt_ref, k_ref, v_ref, item=item, count=count, **ring))


def _page_ids(pt_ref, it, *, page_size, block_k):
    """Table entries of key tile t's copies (a page each, or the tile's rows of one page);
    copies past the last page fetch it again (their keys are masked), so entries past the
    sequence are never read."""
    chunk = min(page_size, block_k)
    last_page = jnp.maximum(it.ctx - 1, 0) // page_size

    def ids(t):
        return [pt_ref[it.s, jnp.minimum((t * block_k + c * chunk) // page_size, last_page)]
                for c in range(block_k // chunk)]
    return ids


def _issue(src, dst, full, ids, t, slot, *, kv, block_k):
    """TMA copies of key tile t's pages (or rows of a page) into ring slot `slot`."""
    page_size = src.shape[2]
    chunk = min(page_size, block_k)
    if page_size > block_k:  # the tile is rows [row, row + block_k) of one page
        rows = pl.ds(lax.rem(t * block_k, page_size), chunk)
    else:
        rows = pl.ds(0, chunk)
    for c, page in enumerate(ids):
        tile_rows = dst.at[slot] if len(ids) == 1 else dst.at[slot, pl.ds(c * chunk, chunk)]
        plgpu.copy_gmem_to_smem(src.at[kv, page, rows], tile_rows, full.at[slot])


def _produce(pt_ref, k_ref, v_ref, *, item, count, k_smem, v_smem, k_full, v_full, k_free,
             v_free, block_k, num_stages):
    """The CTA's items' tiles, in order, through one ring: step g of the CTA fills slot
    g % num_stages once the consumer released it, so the next item's first tiles land while
    the consumer finishes the last one's."""
    def one(i, g):
        it = item(i)
        page_ids = _page_ids(pt_ref, it, page_size=k_ref.shape[2], block_k=block_k)

        @pl.loop(it.lo, it.hi)
        def _tile(t):
            ids = page_ids(t)  # table reads in flight while waiting for the slot
            step = g + t - it.lo
            slot = lax.rem(step, num_stages)
            for src, dst, full, free in ((k_ref, k_smem, k_full, k_free),
                                         (v_ref, v_smem, v_full, v_free)):
                pl.when(step >= num_stages)(lambda free=free: plgpu.barrier_wait(free.at[slot]))
                _issue(src, dst, full, ids, t, slot, kv=it.kv, block_k=block_k)
        return g + it.hi - it.lo

    _drain((k_free, v_free), _each(count, one), num_stages)


def _drain(frees, steps, num_stages):
    """Leave once the ring is empty: every release is awaited."""
    for i in range(num_stages):
        @pl.when(i < steps)
        def _():
            for free in frees:
                plgpu.barrier_wait(free.at[i])


def _consume(q_ref, out_refs, q_smem, o_smem, q_full, *, item, count, split, group, ragged,
             scale, k_smem, v_smem, k_full, v_full, k_free, v_free, block_k, num_stages,
             interpret):
    """The CTA's items in turn, each tile's ring slot counted on from the item before. With
    several items a CTA, q has two slots: the next item's q lands while this one runs."""
    D = q_ref.shape[-1]
    persistent = not (isinstance(count, int) and count == 1)
    q_slot = (lambda i: q_smem.at[lax.rem(i, 2)]) if persistent else (lambda i: q_smem)
    q_bar = (lambda i: q_full.at[lax.rem(i, 2)]) if persistent else (lambda i: q_full)

    def load_q(i):
        it = item(i)
        plgpu.copy_gmem_to_smem(q_ref.at[it.b, it.kv], q_slot(i), q_bar(i))

    def layout(x, lay):
        return x if interpret else plgpu.layout_cast(x, lay)

    cols = wgmma_iota((ROWS, block_k), 1, interpret=interpret)
    v_rows = wgmma_iota((block_k, D), 0, interpret=interpret)
    # Causal rows (several tokens a block): row r is token r // group of the block, which sees
    # the keys up to ctx - n + r // group; a key column c of tile j is visible to row r when
    # c - r // group <= ctx - n - j * block_k.
    diag = (cols - lax.div(wgmma_iota((ROWS, block_k), 0, interpret=interpret), group)
            if ragged else None)

    def one(i, g):
        it = item(i)
        if persistent:
            @pl.when(i + 1 < count)
            def _():  # the other q slot's last output copy has read it: refill it
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                load_q(i + 1)
        plgpu.barrier_wait(q_bar(i))
        q_i = q_slot(i)
        slot_of = lambda j: lax.rem(g + j - it.lo, num_stages)

        def step(j, carry, masked):
            acc, m, l = carry
            slot = slot_of(j)
            sc = wgmma_qk(q_i, k_smem.at[slot], interpret)
            plgpu.barrier_arrive(k_free.at[slot])
            valid = it.ctx - j * block_k  # keys of this tile before the context end
            if masked:
                keep = cols < valid
                if ragged:
                    keep = keep & (diag <= valid - it.n)
                sc = jnp.where(keep, sc, -jnp.inf)
            m_new = jnp.maximum(m, sc.max(axis=1) * scale)
            # A row may see no key yet (its first tiles all past its causal limit): keep exp2
            # finite.
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked and ragged else m_new
            alpha = jnp.exp2(m - m_use)
            p = jnp.exp2(sc * scale - lax.broadcast_in_dim(m_use, sc.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_full.at[slot])
            if masked:
                _zero_rows_from(v_smem.at[slot], valid, v_rows)
            nxt = j + 1
            wait_next = lambda: pl.when(nxt < it.hi)(
                lambda: plgpu.barrier_wait(k_full.at[slot_of(nxt)]))
            acc = wgmma_pv(acc, p.astype(q_i.dtype), v_smem.at[slot], wait_next, interpret)
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        @pl.when(it.hi > it.lo)
        def _():
            plgpu.barrier_wait(k_full.at[slot_of(it.lo)])

        m = layout(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l = layout(jnp.full((ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = layout(jnp.full((ROWS, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        # Tiles before (ctx - n + 1) // block_k hold only keys every row sees; the rest (one
        # tile for decode, which crosses the end) are masked.
        whole = jnp.clip((it.ctx - it.n + 1) // block_k, it.lo, it.hi)
        carry = lax.fori_loop(it.lo, whole, functools.partial(step, masked=False), (acc, m, l))
        acc, m, l = lax.fori_loop(whole, it.hi, functools.partial(step, masked=True), carry)
        _write(out_refs, q_i, o_smem, acc, m, l, it=it, split=split, persistent=persistent)
        return g + it.hi - it.lo

    load_q(0)
    _each(count, one)
    plgpu.wait_smem_to_gmem(0)


def _write(out_refs, q_slot, o_smem, acc, m, l, *, it, split, persistent):
    """An item's normalized output (one split: through its q slot, in q's dtype), or its
    float32 partial output and base-2 log-sum-exp; the copies are awaited later."""
    empty = l == 0.0  # a split without tiles (or context 0)
    norm = jnp.where(empty, 1.0, l)
    acc = acc / lax.broadcast_in_dim(norm, acc.shape, [0])
    live = pl.ds(0, out_refs[0].shape[-2])  # the group's rows, rounded up to a tile of 8
    if len(out_refs) == 1:  # one split: the final output, through q's buffer
        q_slot[...] = acc.astype(q_slot.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_slot.at[live], out_refs[0].at[it.b, it.kv])
        return
    o_tile, lse_tile = o_smem
    if persistent:  # the item before's copies have read the tiles
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    o_tile[...] = acc
    lse_tile[...] = jnp.where(empty, NEG_INF, m + jnp.log(jnp.where(empty, 1.0, l)) * LOG2E)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_tile.at[live], out_refs[0].at[split, it.b, it.kv])
    plgpu.copy_smem_to_gmem(lse_tile.at[live], out_refs[1].at[split, it.b, it.kv])


def _zero_rows_from(v_tile, valid, rows):
    """Zero the V rows at and past `valid` in shared memory: their P is 0, but a NaN left in a
    stale pool slot would still turn 0 * NaN into NaN in P V. Runs once per sequence."""
    v = v_tile[...]
    v_tile[...] = jnp.where(rows < valid, v, jnp.zeros((), v.dtype))
    plgpu.commit_smem()  # the wgmma reads these rows through the async proxy


def pack(q, num_kv_heads):
    """[S, H, D] -> [S, KV, 64, D]: a kv head's G query heads are the CTA's rows, zeros after."""
    S, H, D = q.shape
    G = H // num_kv_heads
    q = q.reshape(S, num_kv_heads, G, D)
    return jnp.pad(q, ((0, 0), (0, 0), (0, ROWS - G), (0, 0)))


def out_rows(group):
    """Output rows per (sequence, kv head): the group rounded up to the 8-row smem tile, so
    split outputs for small groups do not carry 64 rows each."""
    return min(ROWS, -(-group // 8) * 8)


def unpack(o, num_heads):
    """[S, KV, out_rows, D] -> [S, H, D]."""
    S, KV, _, D = o.shape
    return o[:, :, :num_heads // KV].reshape(S, num_heads, D)


def _scratch(dtype, D, block_k, num_stages, num_splits, copies, persistent):
    tiled = lambda shape, dt: plgpu.SMEM(shape, dt, transforms=(
        plgpu.TilingTransform((8, 128 // jnp.dtype(dt).itemsize)), plgpu.SwizzleTransform(128)))
    out = None
    if num_splits > 1:
        out = (tiled((ROWS, D), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32))
    q_shape = (2, ROWS, D) if persistent else (ROWS, D)
    smem = (tiled(q_shape, dtype), tiled((num_stages, block_k, D), dtype),
            tiled((num_stages, block_k, D), dtype), out)
    full = (plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
            plgpu.Barrier(num_barriers=2) if persistent else plgpu.Barrier())
    free = (plgpu.Barrier(num_barriers=num_stages),) * 2
    return [smem, full, free]


def _launch(blocks, page_table, q_packed, k_pages, v_pages, *, group, ragged, rows, sm_scale,
            block_k, num_stages, num_splits, programs, interpret):
    """The kernel over q_packed [NB, KV, 64, D]: `blocks` is context_lens [NB] for decode or,
    `ragged`, [3, NB] (sequence, keys its last token sees, tokens) for blocks of query tokens
    of one sequence, `group` rows a token. `programs`: that many CTAs a split, each taking
    every programs-th (block, kv head) in turn (None: one CTA each).
    Returns [NB, KV, rows, D] in q's dtype, or with splits float32 partial outputs
    [splits, NB, KV, rows, D] and base-2 log-sum-exps [splits, NB, KV, rows]."""
    NB, KV, _, D = q_packed.shape
    page_size = k_pages.shape[2]
    max_tiles = pl.cdiv(page_table.shape[1] * page_size, block_k)
    num_stages = max(1, min(num_stages, pl.cdiv(max_tiles, num_splits)))
    scale = (D ** -0.5 if sm_scale is None else sm_scale) * LOG2E
    if programs is not None and programs >= NB * KV:
        programs = None  # as many CTAs as items: one each
    scratch = _scratch(q_packed.dtype, D, block_k, num_stages, num_splits,
                       copies=block_k // min(page_size, block_k), persistent=programs is not None)
    body = functools.partial(_kernel, scale=scale, block_k=block_k, num_stages=num_stages,
                             num_splits=num_splits, group=group, ragged=ragged,
                             programs=programs, interpret=interpret)

    def entry(*refs):
        pl.run_scoped(lambda *s: body(*refs, s), *scratch, collective_axes="wg")

    if num_splits == 1:
        out_type = jax.ShapeDtypeStruct((NB, KV, rows, D), q_packed.dtype)
    else:
        out_type = (jax.ShapeDtypeStruct((num_splits, NB, KV, rows, D), jnp.float32),
                    jax.ShapeDtypeStruct((num_splits, NB, KV, rows), jnp.float32))
    interp = interpret or None
    if interpret is True:  # or an InterpretGPUParams, e.g. with detect_races=True
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interp = InterpretGPUParams()
    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(num_splits, programs or NB * KV),  # the last axis runs fastest
        grid_names=("split", "item"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interp,
    )(blocks.astype(jnp.int32), page_table.astype(jnp.int32), q_packed, k_pages, v_pages)


STATIC = ("sm_scale", "block_k", "num_stages", "num_splits", "programs", "interpret")


@functools.partial(jax.jit, static_argnames=STATIC)
def paged_attention(q, k_pages, v_pages, context_lens, page_table, *, sm_scale=None,
                    block_k=64, num_stages=4, num_splits=1, programs=None, interpret=False):
    """Decode: q [S, H, D] (one token per sequence), k/v_pages [KV, P, page_size, D],
    context_lens [S] int32, page_table [S, pages_per_seq] int32 -> [S, H, D]."""
    why = supported(q, k_pages, block_k=block_k, num_stages=num_stages, num_splits=num_splits,
                    programs=programs)
    if why:
        raise ValueError(f"paged_mgpu cannot take this call: {why}")
    S, H, D = q.shape
    KV = k_pages.shape[0]
    rows = out_rows(H // KV)
    out = _launch(context_lens, page_table, pack(q, KV), k_pages, v_pages, group=H // KV,
                  ragged=False, rows=rows, sm_scale=sm_scale, block_k=block_k,
                  num_stages=num_stages, num_splits=num_splits, programs=programs,
                  interpret=interpret)
    if num_splits == 1:
        return unpack(out, H).astype(q.dtype)
    o, lse = out  # merged and the padding rows dropped in one launch
    o = merge_splits(o.reshape(num_splits, -1, D), lse.reshape(num_splits, -1), S * H, q.dtype,
                     group=H // KV, stride=rows, interpret=bool(interpret))
    return o.reshape(S, H, D)


# -- mixed prefill chunks and decode tokens ------------------------------------------------------
def ragged_blocks(query_start, context_lens, tokens, num_blocks):
    """Per block of up to `tokens` query tokens of one sequence: [3, NB] (sequence, keys its
    last token sees, its tokens) for the kernel, and the block's first token. Blocks past the
    last real one see no keys, so they read no page."""
    seq, tok = block_metadata(query_start, tokens, num_blocks)
    real = seq < query_start.shape[0] - 1
    seq = jnp.where(real, seq, 0)
    end = query_start[seq + 1]  # the sequence's query tokens end there
    n = jnp.where(real, jnp.minimum(tokens, end - tok), 0)
    sees = jnp.where(real, context_lens[seq] - (end - tok - n), 0)
    return jnp.stack([seq, sees, n]).astype(jnp.int32), tok


def token_places(query_start, T, tokens):
    """Each of T tokens' block and first row there (blocks as `block_metadata` cuts them)."""
    S = query_start.shape[0] - 1
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(query_start[1:], t, side="right", method="compare_all"),
                   0, S - 1)
    n_blk = (query_start[1:] - query_start[:-1] + tokens - 1) // tokens
    i = t - query_start[seq]
    return jnp.cumsum(n_blk)[seq] - n_blk[seq] + i // tokens, i % tokens


@functools.partial(jax.jit, static_argnames=STATIC)
def ragged_paged_attention(q, k_pages, v_pages, query_start, context_lens, page_table, *,
                           sm_scale=None, block_k=64, num_stages=2, num_splits=1, programs=None,
                           interpret=False):
    """Prefill chunks and decode tokens on one flat token axis, q [T, H, D] -> [T, H, D], as
    `paged.ragged_paged_attention` (tokens past query_start[-1] get zeros). A CTA's 64 rows are
    up to 64 // G tokens of one sequence times their G query heads, causal among themselves."""
    why = supported(q, k_pages, block_k=block_k, num_stages=num_stages, num_splits=num_splits,
                    programs=programs)
    if why:
        raise ValueError(f"paged_mgpu cannot take this call: {why}")
    T, H, D = q.shape
    KV, S = k_pages.shape[0], page_table.shape[0]
    G = H // KV
    tpb = ROWS // G  # tokens a block
    nb = pl.cdiv(T, tpb) + S
    blocks, tok = ragged_blocks(query_start, context_lens, tpb, nb)
    # Row t * G + g holds token t of the block, head g; rows past the block's tokens hold
    # whatever tokens follow, and their outputs are never read.
    idx = jnp.minimum(tok[:, None] + jnp.arange(tpb)[None], T - 1)
    qp = q[idx].reshape(nb, tpb, KV, G, D).transpose(0, 2, 1, 3, 4).reshape(nb, KV, tpb * G, D)
    qp = jnp.pad(qp, ((0, 0), (0, 0), (0, ROWS - tpb * G), (0, 0)))
    rows = out_rows(tpb * G)
    out = _launch(blocks, page_table, qp, k_pages, v_pages, group=G, ragged=True, rows=rows,
                  sm_scale=sm_scale, block_k=block_k, num_stages=num_stages,
                  num_splits=num_splits, programs=programs, interpret=interpret)
    if num_splits > 1:
        o, lse = out
        out = merge_splits(o.reshape(num_splits, -1, D), lse.reshape(num_splits, -1),
                           nb * KV * rows, q.dtype, interpret=bool(interpret))
    out = out.reshape(nb, KV, rows, D)
    blk, place = token_places(query_start, T, tpb)
    o = out[blk[:, None, None], jnp.arange(KV)[None, :, None],
            (place * G)[:, None, None] + jnp.arange(G)[None, None, :]]  # [T, KV, G, D]
    live = jnp.arange(T) < query_start[-1]
    return jnp.where(live[:, None, None, None], o, 0).reshape(T, H, D).astype(q.dtype)
