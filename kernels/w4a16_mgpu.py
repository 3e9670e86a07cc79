"""Weight-only integer matmul for Hopper (W4A16, W8A16; Pallas with the Mosaic GPU backend).

The product runs transposed, out^T [N, M] = W^T [N, K] @ x^T: the dequantized weight is the
warpgroup MMA's left operand, which Hopper reads from registers, so it goes from the packed
words to the tensor cores without a trip through shared memory; the activations are the right
operand, a shared-memory tile the TMA brings. A step's M rows are the MMA's N side (16 to 128
a CTA), so a few rows waste little.

The weights are packed as `w4a16_matmul.pack` packs them, with bit planes of SLAB = 16 rows, and
transposed (`pack_t`): [N, K_pad // per] int32 (per = 32 // bits codes a word). A K tile of
`tile_rows(bits)` rows is one [block_n, SLAB] block of words, and bit plane j of it holds the
tile's rows j * SLAB .. j * SLAB + SLAB - 1: a shift, an AND and an OR give the floats
1 + u / 2**bits of the [block_n, SLAB] left operand of an MMA of depth SLAB against columns
j * SLAB... of the x tile, and one FMA the weight (u - zero) * scale, rounded to bf16 as
dequantizing in the graph rounds it. Each plane's MMA is issued as soon as its operand is made;
a tile's are awaited once.

One CTA of one warpgroup per [block_n, block_m] output tile, or (`consumers=2`, from 64 rows)
of two warpgroups over 2 * block_n columns that read one activation tile; with `num_splits` > 1,
that many CTAs share its K tiles and write float32 partial sums that XLA adds. With one
warpgroup the output tile takes the pipeline's shared memory once the loop is done, so at 128
rows two CTAs fit an SM (ptxas gives a thread about 200-226 registers: two CTAs by registers
too). The jnp reference is
`dequantize_t` (or `w4a16_matmul.int_matmul_reference` on the Triton layout of the same codes).
Measured against the Triton kernel and bf16 in `benchmarks/bench_w4a16_mgpu.py`.

In Pallas interpret mode (the CPU tests) the MMAs run as float32 dots of the same bf16 operands;
the pipeline, unpacking, scales and stores run as written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import w4a16_matmul as im
from .w4a16_matmul import F32_BIAS, F32_MAGIC, one_plus
from .w8a8_mgpu import swizzled

SLAB = 16  # K rows of a bit plane here: one MMA's depth (k16), and a 128-row INT4 tile
UNPACKS = ("fma", "magic", "convert", "int4")


def tile_rows(bits: int) -> int:
    return im.tile_rows(bits, SLAB)


def pack_t(codes, bits: int):
    """Unsigned codes [K, N] -> this kernel's words [N, K_pad // (32 // bits)] int32."""
    return im.pack(codes, bits, SLAB).T


def pack_i4(codes):
    """Unsigned INT4 codes [K, N] (symmetric: zero 8) -> the weight as XLA's int4 type,
    [N, K_pad] (K padded to a tile with zeros), for `unpack="int4"`."""
    codes = jnp.asarray(codes, jnp.int32)
    k_pad = -(-codes.shape[0] // tile_rows(4)) * tile_rows(4)
    return jnp.pad(codes.T - 8, ((0, 0), (0, k_pad - codes.shape[0]))).astype(jnp.int4)


def unpack_i4(w, k: int | None = None):
    """`pack_i4`'s int4 weight -> int32 codes [K, N]."""
    return (w.astype(jnp.int32) + 8).T[:k]


def dequantize_i4(w, scale, *, group_size: int, k: int):
    """The f32 weight transposed, [N, K], from `pack_i4`'s int4 weight and its group scales."""
    groups = jnp.arange(k) // group_size
    return w[:, :k].astype(jnp.float32) * scale.astype(jnp.float32).T[:, groups]


def i4_transforms():
    """Shared-memory transforms of an int4 tile of 128-code rows: 64 bytes a row."""
    return (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(64))


def unpack_t(words_t, bits: int, k: int | None = None):
    """This kernel's words -> int32 codes [K, N]."""
    return im.unpack(words_t.T, bits, k, SLAB)


def dequantize_t(words_t, scale, zero, *, bits: int, group_size: int, k: int):
    """The f32 weight transposed, [N, K], read along the words' own rows (no transpose of the
    weight: XLA's dot takes it as [N, K])."""
    per, n = 32 // bits, words_t.shape[0]
    shifts = (jnp.arange(per, dtype=jnp.int32) * bits).reshape(1, 1, per, 1)
    codes = ((words_t.reshape(n, -1, 1, SLAB) >> shifts) & ((1 << bits) - 1)).reshape(n, -1)
    groups = jnp.arange(k) // group_size
    z = 2.0 ** (bits - 1) if zero is None else zero.astype(jnp.float32).T[:, groups]
    return (codes[:, :k].astype(jnp.float32) - z) * scale.astype(jnp.float32).T[:, groups]


SMEM_BYTES = 232448  # shared memory a CTA may take on Hopper


def shared_bytes(bm: int, *, bits: int, group_size: int, block_n: int, consumers: int,
                 num_stages: int, f32_out: bool, zero_points: bool) -> int:
    """Shared memory of the two-warpgroup form: the ring (x, words, scale and zero rows) and
    both output tiles, held together (one warpgroup's output tile reuses its ring)."""
    tile, cols = tile_rows(bits), consumers * block_n
    g_rows = max(1, tile // group_size)
    stage = bm * tile * 2 + cols * SLAB * 4 + g_rows * cols * (4 + 2 * zero_points)
    return num_stages * (stage + 16) + cols * bm * (4 if f32_out else 2)


def supported(m: int, k_pad: int, n: int, *, bits: int, group_size: int, block_n: int = 128,
              block_m: int | None = None, unpack: str = "fma", consumers: int = 1,
              num_stages: int = 2, num_splits: int = 1, zero_points: bool = False,
              **_) -> str | None:
    """Why this kernel cannot take the call, or None."""
    if bits not in (4, 8):
        return f"bits={bits}"
    if unpack not in UNPACKS:
        return f"unpack={unpack!r} is not one of {UNPACKS}"
    if unpack == "int4" and (bits != 4 or zero_points or group_size % tile_rows(4)):
        return ("unpack='int4' takes symmetric INT4 in groups of whole 128-row tiles (or one "
                "group a column)")
    if consumers not in (1, 2):
        return f"consumers={consumers} (1 or 2)"
    if n % (consumers * block_n) or block_n % 64:
        return (f"N={n} is not a multiple of {consumers} x block_n={block_n} (a multiple of "
                f"64)")
    tile = tile_rows(bits)
    if group_size % SLAB or (group_size < tile and tile % group_size) or (
            group_size < k_pad and k_pad % group_size):
        return (f"group_size={group_size} does not tile K tiles of {tile} rows and the padded "
                f"K={k_pad} (or cover it)")
    bm = block_m or rows_block(m)
    if (bm % 16 and not (unpack == "int4" and bm == 8)) or bm > 256:
        return f"block_m={bm} (a multiple of 16, at most 256; 8 with unpack='int4')"
    if consumers > 1:
        need = shared_bytes(bm, bits=bits, group_size=group_size, block_n=block_n,
                            consumers=consumers, num_stages=num_stages,
                            f32_out=num_splits > 1, zero_points=zero_points)
        if need > SMEM_BYTES:
            return f"two warpgroups need {need} bytes of shared memory (at most {SMEM_BYTES})"
    return None


def rows_block(m: int) -> int:
    """The MMA's N side for m rows: m rounded up to 16 (the output tile's 32-byte rows), at
    most 128."""
    return min(128, -(-m // 16) * 16)


def blocks_for(m: int, n: int, k_tiles: int, consumers: int | None = None, *, bits: int = 4,
               group_size: int = 128, zero_points: bool = False) -> dict:
    """Tiles for an [m, K] x [K, n] call (swept on the H100 at 8B layer shapes,
    benchmarks/bench_w4a16_mgpu.py and w4a16_issue.py): 128 output columns a warpgroup.

    From 64 rows, two warpgroups a CTA share its activation tile, one CTA an SM, and K is split
    while the grid stays under one CTA an SM (gate_up / qkv / down at 256 rows: 1.22 / 1.16 /
    1.30x one warpgroup; level to 1.07x at 64 rows; slower at 16-32). Below, one warpgroup, and
    K split while the grid stays under four CTAs an SM up to 64 rows (two above); past 16 rows,
    not at all where the column blocks alone give every SM one (gate_up at 64 rows: 60 us
    against 72 split in two, a second wave of CTAs; 2-6% at 24-48 rows; at 16 the split was 3%
    ahead). Two warpgroups only where their shared memory fits (`supported`)."""
    if consumers is None:
        two = m >= 64 and n % 256 == 0 and blocks_for(m, n, k_tiles, 2)
        fits = two and supported(m, k_tiles * tile_rows(bits), n, bits=bits,
                                 group_size=group_size, zero_points=zero_points, **two) is None
        return two if fits else blocks_for(m, n, k_tiles, 1)
    bn = 128 if n % (128 * consumers) == 0 else 64
    blocks = (n // (bn * consumers)) * -(-m // rows_block(m))
    full = m > 16 and blocks >= 132
    target = 132 if consumers > 1 else 0 if full else 528 if m <= 64 else 264
    return dict(block_n=bn, num_splits=k_splits(blocks, k_tiles, target)) | (
        dict(consumers=consumers) if consumers > 1 else {})


def k_splits(blocks: int, k_tiles: int, target: int) -> int:
    """K split in two, up to 8 ways, while `blocks` CTAs times the split stay under `target`
    and the split divides the K tiles."""
    splits = 1
    while splits < 8 and blocks * splits * 2 <= target and k_tiles % (splits * 2) == 0:
        splits *= 2
    return splits


def i4_blocks(m: int, n: int, k_tiles: int, *, group_size: int = 128) -> dict:
    """Tiles for `unpack="int4"`: the words' rule (`blocks_for`), and up to 8 rows an MMA 8
    rows wide, a ring four deep and K split while the grid stays under eight CTAs an SM (H200,
    8B layers, `bench_w4a16_mgpu --forms i4 --ms 1,2,4,8`: 3-29% less time than the 16-row
    tiles; one row 65 us a layer against the one-row kernel's 67 on the words)."""
    kw = blocks_for(m, n, k_tiles, group_size=group_size)
    if m <= 8:
        kw = dict(kw, block_m=8, num_stages=4,
                  num_splits=k_splits(n // kw["block_n"], k_tiles, 1056))
    return kw | dict(unpack="int4")


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "block_n", "block_m",
                                             "num_stages", "num_splits", "unpack", "wait_every",
                                             "consumers", "interpret"))
def int_matmul_t(x, words_t, scale, zero=None, *, bits: int, group_size: int,
                 block_n: int = 128, block_m: int | None = None, num_stages: int = 2,
                 num_splits: int = 1, unpack: str = "fma", wait_every: int | None = None,
                 consumers: int = 1, interpret: bool = False):
    """x [M, K] bf16 times the packed weight (words_t [N, K_pad // per], scale [G, N] f32,
    zero [G, N] bf16 or None: symmetric) -> out^T [N, M_pad] bf16, or [splits, N, M_pad] f32
    partial sums with num_splits > 1. `unpack`: "fma" makes each code the float 1 + u/2**bits
    with a shift, an AND and an OR and the weight with one FMA; "magic" the float 2**23 + u with
    an OR, then a subtraction and a product; "convert" converts the integer; "int4" takes
    words_t as `pack_i4` makes it (int4 [N, K_pad], symmetric) and converts a whole tile two
    codes at a time (Mosaic GPU's int4 conversion), then scales it in bf16. `wait_every`: make
    that many planes' operands first, then issue their MMAs and await them (the default issues
    each as its operand is made; waiting by 2-8 planes measured level or slower,
    benchmarks/w4a16_issue.py). `consumers` = 2: two warpgroups a CTA, each over block_n
    columns of one shared activation tile."""
    m, k = x.shape
    n, kw = words_t.shape
    per, tile = 32 // bits, tile_rows(bits)
    native = unpack == "int4"
    k_pad = kw if native else kw * per
    tiles = k_pad // tile
    splits = max(s for s in range(1, num_splits + 1) if tiles % s == 0)
    per_split = tiles // splits
    stages = max(1, min(num_stages, per_split))
    why = supported(m, k_pad, n, bits=bits, group_size=group_size, block_n=block_n,
                    block_m=block_m, unpack=unpack, consumers=consumers,
                    num_stages=stages, num_splits=splits,
                    zero_points=zero is not None)
    if why:
        raise ValueError(f"w4a16_mgpu: {why}")
    bm = block_m or rows_block(m)
    mp = -(-m // bm) * bm
    x = jnp.pad(x.astype(jnp.bfloat16), ((0, mp - m), (0, k_pad - k)))
    # scale rows (groups) a K tile spans: one block of them a tile
    g_rows = max(1, tile // group_size)
    g_index = (lambda s: (s, 0)) if group_size < tile else (lambda s: (s * tile // group_size, 0))
    x_t, w_t = swizzled(SLAB, jnp.bfloat16), swizzled(SLAB, jnp.int32)
    if native:  # whole tiles: x's rows 128 columns wide, the weight's 128 codes
        x_t, w_t = swizzled(tile, jnp.bfloat16), i4_transforms()
    out_dtype = jnp.bfloat16 if splits == 1 else jnp.float32
    o_t = swizzled(bm, out_dtype)
    shape = (block_n, bm)

    def load(ref, layout):
        return ref[...] if interpret else plgpu.load(ref, (), layout=layout)

    def weights(w_smem, s_smem, z_smem, mine):
        """The tile's dequantized bf16 [block_n, SLAB] operands, one a bit plane, for the
        columns `mine` of the shared tiles."""
        words = load(w_smem.at[mine], plgpu.Layout.WGMMA)
        col = lambda v: lax.broadcast_in_dim(v, (block_n, SLAB), [0])
        vec = lambda r, g: load(r.at[g, mine], plgpu.Layout.WGMMA.reduce(1)).astype(
            jnp.float32)
        groups = {}
        for j in range(per):
            g = (j * SLAB) // group_size if group_size < tile else 0
            if g not in groups:  # the group's scale, and its zero (a constant when symmetric)
                s = vec(s_smem, g)
                z = 2.0 ** (bits - 1) if z_smem is None else vec(z_smem, g)
                if unpack == "fma":  # (1 + u/2**bits) * 2**bits s - (2**bits + z) s
                    a, b = s * 2.0 ** bits, -(2.0 ** bits + z) * s
                else:
                    a, b = s, z + (F32_BIAS if unpack == "magic" else 0)
                groups[g] = (col(a), b if isinstance(b, float) else col(b))
            s, z = groups[g]
            if unpack == "fma":  # one FMA on 1 + u/2**bits: exact to float32's rounding
                yield (one_plus(words, j, bits) * s + z).astype(jnp.bfloat16)
            else:
                u = lax.shift_right_logical(words, bits * j) & ((1 << bits) - 1)
                if unpack == "magic":  # 2**23 + u, exact: an OR instead of a convert
                    u = lax.bitcast_convert_type(u | F32_MAGIC, jnp.float32)
                yield ((u.astype(jnp.float32) - z) * s).astype(jnp.bfloat16)

    def mma(acc_ref, a, x_smem, j):
        xs = x_smem.at[:, pl.ds(j * SLAB, SLAB)]
        if interpret:
            acc_ref[...] += jnp.dot(a.astype(jnp.float32), xs[...].astype(jnp.float32).T)
        else:
            plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(xs, (1, 0)))

    def step_i4(acc_ref, x_smem, w_smem, s_smem, mine):
        """The tile's int4 codes to bf16 (a relayout into the MMA's layout, then Mosaic GPU's
        conversion of two codes at a time), times its group's scale, then one MMA of it."""
        if interpret:
            w = w_smem.at[mine][...].astype(jnp.bfloat16)
        else:
            w = plgpu.load(w_smem, (mine,), layout=plgpu.Layout.WGMMA_UPCAST_4X)
            w = plgpu.layout_cast(w, plgpu.Layout.WGMMA).astype(jnp.bfloat16)
        s = load(s_smem.at[0, mine], plgpu.Layout.WGMMA.reduce(1)).astype(jnp.bfloat16)
        w = w * lax.broadcast_in_dim(s, w.shape, [0])
        if interpret:
            acc_ref[...] += jnp.dot(w.astype(jnp.float32), x_smem[...].astype(jnp.float32).T)
        else:
            plgpu.wgmma(acc_ref, w, plgpu.transpose_ref(x_smem, (1, 0)))
            plgpu.wgmma_wait(0)

    def step(acc_ref, x_smem, w_smem, s_smem, z_smem, mine=slice(None)):
        """Each plane's weights straight from registers into its MMA; all awaited before the
        step returns its slots."""
        if native:
            return step_i4(acc_ref, x_smem, w_smem, s_smem, mine)
        planes = weights(w_smem, s_smem, z_smem, mine)
        if wait_every is None:
            for j, w in enumerate(planes):
                mma(acc_ref, w, x_smem, j)
        else:
            every = min(wait_every, per)
            for j0 in range(0, per, every):
                ws = lax.optimization_barrier(tuple(next(planes) for _ in range(every)))
                for j, w in enumerate(ws, j0):
                    mma(acc_ref, w, x_smem, j)
                if not interpret and j0 + every < per:
                    plgpu.wgmma_wait(0)
        if not interpret:
            plgpu.wgmma_wait(0)

    def specs_and_views(x_gmem, w_gmem, s_gmem, z_gmem, cols, rows, si):
        """The split's K tiles of x and of the words (and their scale and zero rows) for the
        CTA's columns and rows: the pipeline's specs and the views they read."""
        ks = pl.ds(si * per_split * tile, per_split * tile)
        # the split's scale rows: its groups, or the one group a split shorter than it lies in
        g_span = max(1, per_split * tile // group_size)
        gs = pl.ds(si * per_split * tile // group_size, g_span) if group_size < k_pad else (
            pl.ds(0, 1))
        width = cols.size
        w_cols = tile if native else SLAB  # a K tile's columns of the weight
        specs = [plgpu.BlockSpec((bm, tile), lambda s: (0, s), transforms=x_t),
                 plgpu.BlockSpec((width, w_cols), lambda s: (0, s), transforms=w_t),
                 plgpu.BlockSpec((g_rows, width), g_index)]
        args = [x_gmem.at[rows, ks], w_gmem.at[cols, pl.ds(si * per_split * w_cols,
                                                             per_split * w_cols)],
                s_gmem.at[gs, cols]]
        if zero is not None:
            specs.append(plgpu.BlockSpec((g_rows, width), g_index))
            args.append(z_gmem.at[gs, cols])
        return specs, args

    def accumulate(fn):
        """fn(acc_ref) with a zeroed float32 accumulator; in interpret mode a shared-memory
        scratch stands in for it."""
        if not interpret:
            return pl.run_scoped(fn, plgpu.ACC(shape, jnp.float32))

        def zeroed(acc_ref):
            acc_ref[...] = jnp.zeros(shape, jnp.float32)
            return fn(acc_ref)
        return pl.run_scoped(zeroed, plgpu.SMEM(shape, jnp.float32))

    def store(o_smem, acc, o_gmem, cols, rows, si):
        o_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[cols, rows] if splits == 1 else
                                o_gmem.at[si, cols, rows])
        plgpu.wait_smem_to_gmem(0)

    def unpack_args(gmem):  # (x, words, scale, zero or None, out)
        x_gmem, w_gmem, s_gmem, *rest = gmem
        return (x_gmem, w_gmem, s_gmem) + (tuple(rest) if zero is not None else (None, *rest))

    def body(*gmem):
        x_gmem, w_gmem, s_gmem, z_gmem, o_gmem = unpack_args(gmem)
        ni, mi, si = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("s")
        cols, rows = pl.ds(ni * block_n, block_n), pl.ds(mi * bm, bm)
        specs, args = specs_and_views(x_gmem, w_gmem, s_gmem, z_gmem, cols, rows, si)

        def product(acc_ref):
            body = lambda _, x_s, w_s, s_s, *z_s: step(acc_ref, x_s, w_s, s_s, *(z_s or (None,)))
            plgpu.emit_pipeline(body, grid=(per_split,), in_specs=specs,
                                max_concurrent_steps=stages)(*args)
            return acc_ref[...]
        acc = accumulate(product)
        # after the pipeline's scope, so the output tile reuses its buffers' shared memory:
        # at 128 rows that leaves room for two CTAs an SM
        pl.run_scoped(lambda o_smem: store(o_smem, acc, o_gmem, cols, rows, si),
                      plgpu.SMEM(shape, out_dtype, transforms=o_t))

    def body_shared(*gmem):
        """Two warpgroups a CTA, each over block_n of its columns, both reading one x tile: half
        the activations' L2 traffic a column. The first warpgroup's leading thread issues the
        copies, a refill once both have released the slot (a producer warpgroup of its own
        measured level or slower, benchmarks/w4a16_issue.py)."""
        x_gmem, w_gmem, s_gmem, z_gmem, o_gmem = unpack_args(gmem)
        ni, mi, si, wg = (lax.axis_index(a) for a in ("n", "m", "s", "wg"))
        cta_n, rows = consumers * block_n, pl.ds(mi * bm, bm)
        specs, views = specs_and_views(x_gmem, w_gmem, s_gmem, z_gmem, pl.ds(ni * cta_n, cta_n),
                                       rows, si)
        slot = lambda t: t % stages if isinstance(t, int) else lax.rem(t, stages)
        leader = wg == 0

        def consume(smem, o_smem, full, free, acc_smem=None):
            def fetch(t):  # K tile t of every operand into its slot
                for view, spec, buf in zip(views, specs, smem):
                    src = view.at[tuple(pl.ds(i * d, d) for i, d in zip(spec.index_map(t),
                                                                        spec.block_shape))]
                    plgpu.copy_gmem_to_smem(src, buf.at[slot(t)], full.at[slot(t)])
            pl.when(leader)(lambda: _each(fetch, range(min(stages, per_split))))

            def product(acc_ref):
                @pl.loop(0, per_split)
                def _(t):
                    @pl.when(leader & (t >= 1) & (t - 1 + stages < per_split))
                    def _():  # tile t - 1's slot takes tile t - 1 + stages
                        plgpu.barrier_wait(free.at[slot(t - 1)])
                        fetch(t - 1 + stages)
                    plgpu.barrier_wait(full.at[slot(t)])
                    step(acc_ref, *(b.at[slot(t)] for b in smem), *([None] * (zero is None)),
                         mine=pl.ds(wg * block_n, block_n))
                    plgpu.barrier_arrive(free.at[slot(t)])
                # the releases no refill awaited: every phase observed (the interpreter checks)
                pl.when(leader)(lambda: _each(lambda t: plgpu.barrier_wait(free.at[slot(t)]),
                                              range(max(0, per_split - stages), per_split)))
                return acc_ref[...]
            if acc_smem is None:
                acc = pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))
            else:  # interpret mode allocates only for every warpgroup at once
                acc_smem[wg] = jnp.zeros(shape, jnp.float32)
                acc = product(acc_smem.at[wg])
            store(o_smem.at[wg], acc, o_gmem, pl.ds(ni * cta_n + wg * block_n, block_n),
                  rows, si)

        extra = dict(acc_smem=plgpu.SMEM((consumers, *shape), jnp.float32)) if interpret else {}
        pl.run_scoped(
            consume, smem=[plgpu.SMEM((stages, *sp.block_shape), v.dtype,
                                      transforms=sp.transforms) for sp, v in zip(specs, views)],
            o_smem=plgpu.SMEM((consumers, *shape), out_dtype, transforms=o_t),
            full=plgpu.Barrier(num_arrivals=len(specs), num_barriers=stages),
            free=plgpu.Barrier(num_arrivals=consumers, num_barriers=stages), **extra,
            collective_axes="wg")

    interp = interpret or None
    if interpret is True:  # or an InterpretGPUParams, e.g. with detect_races=True
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interp = InterpretGPUParams()
    out_shape = (n, mp) if splits == 1 else (splits, n, mp)
    operands = (x, words_t, scale) + (() if zero is None else (zero,))
    grid = (n // (consumers * block_n), mp // bm, splits)
    kernel = dict(body=body) if consumers == 1 else dict(
        body=body_shared, num_threads=consumers, thread_name="wg")
    return plgpu.kernel(
        **kernel,
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=grid,
        grid_names=("n", "m", "s"),
        interpret=interp,
    )(*operands)


def _each(fn, items):
    """fn over items, returning None (what a `pl.when` body must)."""
    for item in items:
        fn(item)


def int_matmul(x, words_t, scale, zero=None, perm=None, *, bits: int, group_size: int,
               interpret: bool = False, **blocks):
    """x [M, K] times the packed weight with words transposed ([N, K_pad // per]) -> [M, N] in
    x's dtype."""
    if perm is not None:
        x = x[..., perm]
    m = x.shape[0]
    y = int_matmul_t(x, words_t, scale, zero, bits=bits, group_size=group_size,
                     interpret=interpret, **blocks)
    if y.ndim == 3:
        y = y.sum(0)
    return y[:, :m].T.astype(x.dtype)
