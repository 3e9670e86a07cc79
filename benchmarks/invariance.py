"""Batch invariance on the GPU: is a row's result the same bits whatever else the step holds, and
what does it cost?

    python -m benchmarks.invariance --out $OUT          # GPU (H100: ~4 minutes)
    python -m benchmarks.invariance --out DIR --tiny    # CPU check of the script

1. products: `kernels.invariant_matmul` on the Llama-3-8B layer shapes (and the LM head, read
   [N, K] as a tied embedding is) for M from 1 to 8192 rows of one random x: each call's rows
   against the 8192-row call's, bit for bit, for the picked tiles and four forced ones; XLA's
   own dot beside it (how far its rows move with M); the error against a float32-accumulated
   reference; the device time of both (L2 flushed, median).
2. probes (alone with --probes): the rows of the norm, the sampler's reductions, the attention
   and every module of the forward, alone against among 64 and in a mixed step.
3. engine: the 8B-shaped model (random bf16 weights) through `LLM`, `batch_invariant` off and
   on: batch-1 decode ms a token (`LLM.stream`), the wall time of 64 sequences (`LLM.generate`,
   128-token prompts and outputs, greedy), and whether prompt 0 alone (from a clean prefix
   cache, and with its prompt cached) gives the tokens and logprobs it gives among the 64.
   --buckets instead: prompt 0 alone in 2-token against 64-token decode steps.

Writes OUT/invariance*.json and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallasite import kernels
from pallasite.kernels import invariant_matmul as im
from pallasite.kernels import tuning

from .common import device_times, run_info

SHAPES = [("qkv", 4096, 6144, "kn"), ("o", 4096, 4096, "kn"), ("gate_up", 4096, 28672, "kn"),
          ("down", 14336, 4096, "kn"), ("lm_head", 4096, 128256, "nk")]
TINY_SHAPES = [("qkv", 256, 384, "kn"), ("lm_head", 256, 512, "nk")]
FORCED = [dict(block_m=64, block_n=64, block_k=64, split=True),
          dict(block_m=64, block_n=128, block_k=64, split=False, flat=False),
          dict(block_m=128, block_n=128, block_k=64, split=False, num_warps=8, num_stages=3),
          dict(block_m=128, block_n=256, block_k=64, split=True, num_warps=8, num_stages=3)]


def products(tiny: bool, reps: int, names=None, timed_too: bool = True, rows=None,
             forced: bool = True) -> list[dict]:
    interpret = tiny
    rows = rows or ([1, 2, 5, 16, 64] if tiny else [1, 2, 5, 8, 64, 200, 1024, 8192])
    timed = [1, 16, 64] if tiny else [1, 8, 64, 256, 1024, 8192]
    records = []
    all_rows = rows
    for name, k, n, layout in TINY_SHAPES if tiny else SHAPES:
        if names and name not in names:
            continue
        # The LM head's float32 logits: 1024 rows at most.
        rows = [r for r in all_rows if r <= 1024] if n > 100_000 and not tiny else all_rows
        key = jax.random.key(k + n)
        x = jax.random.normal(key, (rows[-1], k), jnp.bfloat16)
        wshape = (n, k) if layout == "nk" else (k, n)
        w = (jax.random.normal(jax.random.fold_in(key, 1), wshape, jnp.float32)
             / np.sqrt(k)).astype(jnp.bfloat16)

        # The weight is an argument everywhere: closed over, it became a constant of each
        # compiled program (1 GB for the LM head), and compiling took minutes.
        def ours(xm, wm=w, **blocks):
            kw = im.blocks_for(xm.shape[0], k, n) | blocks
            return im.invariant_matmul(xm, wm, layout=layout, interpret=interpret, **kw)
        xla_jit = jax.jit(lambda xm, wm: kernels.matmul(xm, wm, layout=layout))
        xla = lambda xm: xla_jit(xm, w)
        full, full_xla = np.asarray(ours(x), np.float32), np.asarray(xla(x), np.float32)
        ref = np.asarray(im.reference(x, w, layout=layout, out_dtype=jnp.float32))
        rec = dict(name=name, k=k, n=n, layout=layout, finite=bool(np.isfinite(full).all()),
                   rel_err=float(np.linalg.norm(full - ref) / np.linalg.norm(ref)),
                   xla_rel_err=float(np.linalg.norm(full_xla - ref) / np.linalg.norm(ref)),
                   rows_bitwise={}, xla_rows_max_diff={}, forced_bitwise={}, ms={})
        for m in rows[:-1]:
            rec["rows_bitwise"][m] = bool(np.array_equal(np.asarray(ours(x[:m]), np.float32),
                                                          full[:m]))
            rec["xla_rows_max_diff"][m] = float(np.max(np.abs(
                np.asarray(xla(x[:m]), np.float32) - full_xla[:m])))
        for i, blocks in enumerate(FORCED if forced else []):
            for m in (rows[1], rows[-1]):
                if n % blocks["block_n"] == 0:
                    got = np.asarray(ours(x[:m], **blocks), np.float32)
                    rec["forced_bitwise"][f"{i}@{m}"] = bool(np.array_equal(got, full[:m]))
        for m in timed if timed_too else []:  # one trace per size: all of them in one outgrew the profiler's limit
            (t, _), (t_xla, _) = device_times([(jax.jit(ours), (x[:m], w)),
                                               (xla_jit, (x[:m], w))], reps)
            rec["ms"][m] = dict(invariant=t, xla=t_xla, ratio=t / t_xla)
        print(json.dumps(rec), flush=True)
        records.append(rec)
    return records


def probes(tiny: bool, layers: int | None = None) -> list[dict]:
    """Row checks of the step's parts: the norm, the sampler's reductions, the attention and
    every module of the forward (2 layers; and `layers` of them at context 241)."""
    return [norm_rows([1, 2, 8, 64, 1024], tiny), sampler_rows([1, 2, 8, 64, 256], tiny),
            attention_rows(tiny), layer_rows(tiny), layer_rows(tiny, 141, 16),
            layer_rows(tiny, 241, 16), *([layer_rows(tiny, 241, 16, layers)] if layers else [])]


def attention_rows(tiny: bool) -> dict:
    """Inside `batch_invariant`, sequence 0's decode row in a step of 1 sequence (2-token
    bucket) against the same row among 64 sequences, and among 63 decoding sequences plus a
    100-token prefill chunk (a mixed step), on one random cache (32/8 heads, d 128, bf16)."""
    H, KV, D, ps, ctx = (8, 2, 32, 16, 100) if tiny else (32, 8, 128, 16, 700)
    S, width = 64, -(-ctx // ps) + 2
    key = jax.random.key(11)
    kp, vp = (jax.random.normal(jax.random.fold_in(key, i), (KV, S * width, ps, D), jnp.bfloat16)
              for i in range(2))
    table = jnp.arange(S * width, dtype=jnp.int32).reshape(S, width)
    q = jax.random.normal(jax.random.fold_in(key, 2), (256, H, D), jnp.bfloat16)

    def step(q_lens, T):
        qs = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
        lens = jnp.asarray([ctx] * len(q_lens), jnp.int32)
        with tuning.batch_invariant():
            f = jax.jit(lambda *a: kernels.ragged_paged_attention(*a, interpret=tiny))
            return np.asarray(f(q[:T], kp, vp, qs, lens, table[:len(q_lens)])[0], np.float32)
    alone = step([1], 2)
    return dict(name="attention", among_64=bool(np.array_equal(alone, step([1] * 64, 64))),
                mixed=bool(np.array_equal(alone, step([1] * 63 + [100], 256))),
                chunks=chunk_rows(q, kp, vp, table, tiny),
                contexts={width: context_rows(q, kp, vp, table[:, :width], tiny)
                          for width in ((4, 9) if tiny else (16, 46))})


def context_rows(q, kp, vp, table, tiny: bool) -> dict:
    """A decode row alone (2-token bucket) against the same row among 64 decoding sequences of
    other contexts, for every context the table holds: the contexts at which they differ. The
    table's width sets the number of key splits (one for 16 pages, two for 46)."""
    S, T = 64, 64
    top = min(table.shape[1] * kp.shape[2], 96 if tiny else 768)
    others = np.random.default_rng(1).integers(1, top + 1, S)
    with tuning.batch_invariant():
        f = jax.jit(lambda *a: kernels.ragged_paged_attention(*a, interpret=tiny)[0])
        one = jnp.asarray([0, 1], jnp.int32)
        many = jnp.arange(S + 1, dtype=jnp.int32)
        differ = []
        for ctx in range(1, top + 1):
            a = f(q[:2], kp, vp, one, jnp.asarray([ctx], jnp.int32), table[:1])
            b = f(q[:T], kp, vp, many, jnp.asarray([ctx, *others[1:]], jnp.int32), table[:S])
            if not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)):
                differ.append(ctx)
    return dict(checked=top, differ=len(differ), first=differ[:24])


def chunk_rows(q, kp, vp, table, tiny: bool) -> dict:
    """One sequence's last 16 positions as the tail of a whole-prompt chunk, as a 16-token
    chunk over a cached prefix (a prefix-cache hit), and as 16 decode rows (tokens made one at
    a time): the attention rows of each, bit for bit against the whole prompt's."""
    n, tail = (64, 16) if tiny else (256, 16)

    def call(queries, q_lens, lens):
        qs = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
        rows = jnp.repeat(table[:1], len(q_lens), axis=0)  # every row: sequence 0's pages
        with tuning.batch_invariant():
            f = jax.jit(lambda *a: kernels.ragged_paged_attention(*a, interpret=tiny))
            return np.asarray(f(queries, kp, vp, qs, jnp.asarray(lens, jnp.int32), rows),
                              np.float32)
    whole = call(q[:n], [n], [n])[n - tail:]
    cached = call(q[n - tail:n], [tail], [n])
    decode = call(q[n - tail:n], [1] * tail, list(range(n - tail + 1, n + 1)))
    return dict(prefix_hit=bool(np.array_equal(whole, cached)),
                decode_rows=bool(np.array_equal(whole, decode)),
                max_diff=float(max(np.abs(whole - cached).max(), np.abs(whole - decode).max())))


def sampler_rows(rows, tiny: bool) -> dict:
    """The sampler's reductions over the vocabulary (log-softmax for logprobs, argmax for
    greedy tokens) on the first m rows of float32 logits against the same rows of the largest
    call."""
    V = 512 if tiny else 128256
    x = jax.random.normal(jax.random.key(9), (rows[-1], V), jnp.float32) * 4
    lsm, arg = jax.jit(lambda a: jax.nn.log_softmax(a, axis=-1)), jax.jit(
        lambda a: jnp.argmax(a, axis=-1))
    full_lsm, full_arg = np.asarray(lsm(x)), np.asarray(arg(x))
    from pallasite.serving import sampling
    sample = jax.jit(sampling.sample, static_argnames="mode")

    def engine_sampler(m):  # greedy rows that ask for logprobs: the sampler's "sample" mode
        floats, ints = sampling.pack_rows([dict(temperature=0.0, logprobs=5)] * m, m)
        rows = sampling.Rows.from_packed(jnp.asarray(floats), jnp.asarray(ints))
        return [np.asarray(a) for a in sample(x[:m], rows, sampling.init_history(m, V), "sample")]
    full = engine_sampler(rows[-1])
    return dict(name="sampler", vocab=V, log_softmax_rows_bitwise={
        m: bool(np.array_equal(np.asarray(lsm(x[:m])), full_lsm[:m])) for m in rows[:-1]},
        argmax_rows_equal={m: bool(np.array_equal(np.asarray(arg(x[:m])), full_arg[:m]))
                           for m in rows[:-1]},
        sample_mode_rows_bitwise={m: all(np.array_equal(a, b[:m]) for a, b in zip(
            engine_sampler(m), full)) for m in rows[:-1]})


def norm_rows(rows, tiny: bool) -> dict:
    """The model's RMSNorm (an XLA reduction over each row) on the first m rows against the
    same rows of the largest call."""
    from pallasite.model.layers import RMSNorm
    hidden = 256 if tiny else 4096
    norm = RMSNorm(hidden, 1e-5, jnp.bfloat16)
    x = jax.random.normal(jax.random.key(5), (rows[-1], hidden), jnp.bfloat16) * 3
    params = norm.init(jax.random.key(0), x[:1])
    f = jax.jit(norm.apply)
    full = np.asarray(f(params, x), np.float32)
    return dict(name="rms_norm", hidden=hidden, rows_bitwise={
        m: bool(np.array_equal(np.asarray(f(params, x[:m]), np.float32), full[:m]))
        for m in rows[:-1]})


def layer_rows(tiny: bool, ctx: int = 300, width: int | None = None, layers: int = 2) -> dict:
    """Where a decode row first depends on its batch: the model's forward (2 layers of the 8B
    shape, random bf16 weights and cache) inside `batch_invariant(True)` for sequence 0 decoding
    alone (2-token bucket), among 64 decoding sequences, and beside a 100-token prefill chunk;
    every module's output row 0 (flax `capture_intermediates`) compared bit for bit, in the
    order the modules ran."""
    from benchmarks.bench_quant import LLAMA3_8B, TINY
    from pallasite.model import config_from_dict, init_params
    from pallasite.model.attention import Batch
    from pallasite.model.transformer import Decoder, forward, init_kv_cache
    config = config_from_dict(dict(TINY if tiny else LLAMA3_8B, num_hidden_layers=layers))
    params = jax.jit(lambda: init_params(config, 0, jnp.bfloat16))()
    ps, S = 16, 64
    width = width or -(-(ctx + 100) // ps) + 1
    kv = [tuple(jax.random.normal(jax.random.key(3 * i + j), a.shape, a.dtype)
                for j, a in enumerate(layer))
          for i, layer in enumerate(init_kv_cache(config, S * width, ps, jnp.bfloat16))]
    table = jnp.arange(S * width, dtype=jnp.int32).reshape(S, width)
    rng = np.random.default_rng(0)

    def run(q_lens, T):
        n = len(q_lens)
        qs = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        pos = np.concatenate([np.arange(ctx - q, ctx) for q in q_lens]).astype(np.int32)
        seq = np.repeat(np.arange(n), q_lens)
        slots = (np.asarray(table)[seq, pos // ps] * ps + pos % ps).astype(np.int32)
        pad = T - len(pos)
        tokens = np.concatenate([[7], rng.integers(0, config.vocab_size, len(pos) - 1), [0] * pad])
        batch = Batch(jnp.asarray(qs), jnp.full((n,), ctx, jnp.int32), table[:n],
                      jnp.asarray(np.concatenate([slots, [-1] * pad]), jnp.int32),
                      jnp.asarray(qs[1:] - 1))

        def f(params, kv, tokens, pos):
            with tuning.batch_invariant(True):
                return Decoder(config, jnp.bfloat16).apply(
                    {"params": params}, tokens, pos, None, kv, batch,
                    capture_intermediates=True, mutable=["intermediates"])
        (_, _), state = jax.jit(f)(params, kv, jnp.asarray(tokens, jnp.int32),
                                   jnp.asarray(np.concatenate([pos, [0] * pad]), jnp.int32))
        rows = {}
        for path, leaf in jax.tree_util.tree_leaves_with_path(state["intermediates"]):
            if 1 <= leaf.ndim <= 3 and leaf.shape[0] in (T, n):  # not the [KV, pages, ...] cache
                rows[jax.tree_util.keystr(path)] = np.asarray(leaf[0], np.float32)

        def g(params, kv, tokens, pos):  # as the engine compiles it: no module output kept
            with tuning.batch_invariant(True):
                return forward(params, config, tokens, pos, kv, batch)
        logits, new_kv = jax.jit(g)(params, kv, jnp.asarray(tokens, jnp.int32),
                                    jnp.asarray(np.concatenate([pos, [0] * pad]), jnp.int32))
        rows["forward: logits"] = np.asarray(logits[0], np.float32)
        page, slot = int(table[0, (ctx - 1) // ps]), (ctx - 1) % ps
        for i, layer in enumerate(new_kv):
            rows[f"forward: layer {i} K/V"] = np.stack(
                [np.asarray(a[:, page, slot], np.float32) for a in layer[:2]])
        return rows

    alone = run([1], 2)
    out = dict(name="layers", layers=layers, modules=len(alone), context=ctx, pages=width)
    for case, (q_lens, T) in {"among_64": ([1] * S, S), "mixed": ([1, 100], 128)}.items():
        other = run(q_lens, T)
        differ = [k for k in alone if k in other and not np.array_equal(alone[k], other[k])]
        out[case] = dict(first_different=differ[:3], different=len(differ),
                         forward_different=[k for k in differ if k.startswith("forward")])
    return out


LARGE = [dict(block_m=128, block_n=128, split=False, num_warps=8, num_stages=3),
         dict(block_m=128, block_n=128, split=False, flat=True, num_warps=8, num_stages=3),
         dict(block_m=128, block_n=256, split=False, flat=True, num_warps=8, num_stages=3),
         dict(block_m=128, block_n=256, split=False, num_warps=8, num_stages=4),
         dict(block_m=128, block_n=128, split=False, flat=True, num_warps=4, num_stages=4),
         dict(block_m=64, block_n=128, split=False, flat=True, num_warps=4, num_stages=4),
         dict(block_m=256, block_n=128, split=False, flat=True, num_warps=8, num_stages=3),
         dict(block_m=128, block_n=128, block_k=128, split=False, flat=True, num_warps=8,
              num_stages=3)]
SMALL = [dict(block_m=64, block_n=128, split=True, num_warps=4, num_stages=4),
         dict(block_m=64, block_n=64, split=True, num_warps=4, num_stages=4),
         dict(block_m=64, block_n=64, split=True, num_warps=4, num_stages=6),
         dict(block_m=64, block_n=32, split=True, num_warps=4, num_stages=4),
         dict(block_m=64, block_n=128, block_k=128, split=True, num_warps=4, num_stages=3),
         dict(block_m=64, block_n=64, split=True, num_warps=4, num_stages=3)]


def sweep(tiny: bool, reps: int) -> list[dict]:
    """Tiles against each other at decode and prefill sizes, each checked bit for bit against
    the picked tiles' rows of the full call."""
    records = []
    for name, k, n, layout in (TINY_SHAPES if tiny else SHAPES[:4])[:3]:
        key = jax.random.key(k + n)
        m_max = 64 if tiny else 8192
        x = jax.random.normal(key, (m_max, k), jnp.bfloat16)
        w = (jax.random.normal(jax.random.fold_in(key, 1), (k, n), jnp.float32)
             / np.sqrt(k)).astype(jnp.bfloat16)
        run = lambda xm, **b: im.invariant_matmul(xm, w, interpret=tiny, **b)
        full = np.asarray(run(x, **im.blocks_for(m_max, k, n)), np.float32)
        for m in ([1, 16, 64] if tiny else [1, 8, 64, 256, 1024, 8192]):
            configs = [c for c in (SMALL if m <= 256 else LARGE) if n % c["block_n"] == 0]
            xm, bits = x[:m], []
            for c in configs:
                bits.append(bool(np.array_equal(np.asarray(run(xm, **c), np.float32),
                                                full[:m])))
            calls = [(jax.jit(lambda a, b, c=c: im.invariant_matmul(a, b, interpret=tiny, **c)),
                      (xm, w)) for c in configs]
            calls.append((jax.jit(lambda a, b: kernels.matmul(a, b)), (xm, w)))
            times = [t for t, _ in device_times(calls, reps)]
            for c, t, b in zip(configs, times, bits):
                rec = dict(name=name, m=m, config=c, ms=t, xla_ms=times[-1],
                           ratio=t / times[-1], bitwise=b)
                print(json.dumps(rec), flush=True)
                records.append(rec)
    return records


def differences(name: str, a, b) -> dict:
    """Whether two completions agree, and the first token and the first logprob (the first
    step whose logits differ) at which they part."""
    first = lambda xs, ys: next((i for i, (x, y) in enumerate(zip(xs, ys)) if x != y), None)
    return {f"{name}_equal": a.token_ids == b.token_ids,
            f"{name}_first_token_difference": first(a.token_ids, b.token_ids),
            f"{name}_first_logprob_difference": first([t.logprob for t in a.logprobs],
                                                      [t.logprob for t in b.logprobs])}


def engine_setup(tiny: bool, layers: int | None = None):
    """The engine check's model (8B shape, random bf16; `layers` of them if given), prompts and
    greedy settings."""
    from benchmarks.bench_quant import LLAMA3_8B, TINY
    from pallasite.model import config_from_dict, init_params
    from pallasite.serving.llm import SamplingParams
    config = TINY if tiny else LLAMA3_8B
    config = config_from_dict(dict(config, num_hidden_layers=layers) if layers else config)
    params = jax.jit(lambda: init_params(config, 0, jnp.bfloat16))()
    prompt_len, new, batch = (16, 16, 4) if tiny else (128, 128, 64)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, config.vocab_size, (batch, prompt_len)).tolist()
    sampling = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, logprobs=0)
    pages = -(-(prompt_len + new) // 16)
    sizes = dict(max_num_seqs=batch, max_num_batched_tokens=prompt_len,
                 num_pages=batch * pages + 8, page_buckets=[pages], max_model_len=prompt_len + new)
    return config, params, prompts, sampling, sizes


def buckets(tiny: bool, layers: int | None = None) -> dict:
    """Does prompt 0 part from the batch through the decode step's shape or through the other
    rows in it? Batch-invariant engines whose smallest token bucket is 2 ("small") or the
    batch's own 64 ("wide"): prompt 0 alone and among the 64 in each, compared pairwise."""
    from pallasite.serving.llm import LLM
    config, params, prompts, sampling, sizes = engine_setup(tiny, layers)
    batch, prompt_len = len(prompts), len(prompts[0])
    runs = {}
    for name, token_buckets in (("small", [2, 8, batch, prompt_len]), ("wide", [batch, prompt_len])):
        llm = LLM.from_params(config, params, None, batch_invariant=True,
                              token_buckets=token_buckets, **sizes)
        runs[f"{name}_many"] = llm.generate(prompts, sampling)[0]
        llm.reset_prefix_cache()
        runs[f"{name}_alone"] = llm.generate(prompts[:1], sampling)[0]
        llm.close()
    out = dict(name="buckets", layers=config.num_layers)
    for a, b in (("small_alone", "wide_alone"), ("wide_alone", "wide_many"),
                 ("small_alone", "small_many"), ("small_many", "wide_many")):
        out |= differences(f"{a}_vs_{b}", runs[a], runs[b])
    print(json.dumps(out), flush=True)
    return out


def engine(tiny: bool, modes=(False, True)) -> list[dict]:
    from pallasite.serving.llm import LLM
    config, params, prompts, sampling, sizes = engine_setup(tiny)
    batch, prompt_len = len(prompts), len(prompts[0])
    records = []
    for invariant in modes:
        llm = LLM.from_params(config, params, None, batch_invariant=invariant,
                              token_buckets=[2, 8, batch, prompt_len], **sizes)
        many = llm.generate(prompts, sampling)
        list(llm.stream(prompts[0], sampling))
        stamps = [time.perf_counter() for _ in llm.stream(prompts[0], sampling)]
        cached = llm.generate(prompts[:1], sampling)[0]  # its prompt's pages found cached
        llm.reset_prefix_cache()
        alone = llm.generate(prompts[:1], sampling)[0]  # computed whole, as in the batch
        t = time.perf_counter()
        llm.generate(prompts, sampling)
        wall = time.perf_counter() - t
        llm.reset_prefix_cache()
        again = llm.generate(prompts, sampling)  # the same run twice: is the device deterministic?
        rec = dict(batch_invariant=invariant,
                   batch1_ms_per_token=1e3 * float(np.median(np.diff(stamps[1:]))),
                   batch64_wall_s=wall,
                   cached_tokens=cached.cached_tokens,
                   rerun_all_equal=[a.token_ids for a in again] == [m.token_ids for m in many],
                   **differences("rerun", again[0], many[0]),
                   **differences("alone", alone, many[0]),
                   **differences("prefix_hit", cached, many[0]))
        print(json.dumps(rec), flush=True)
        records.append(rec)
        llm.close()
    return records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="small shapes, interpret mode (CPU)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="only the tile sweep")
    ap.add_argument("--engine-only", action="store_true")
    ap.add_argument("--layers", type=int, help="the buckets check's model depth (default 32); "
                    "with --probes, one more layer check at this depth")
    ap.add_argument("--buckets", action="store_true",
                    help="only the engine check of the decode step's shape against its rows")
    ap.add_argument("--probes", action="store_true",
                    help="only the row checks of the norm, the attention and each module")
    ap.add_argument("--shapes", help="comma-separated products to run (default: all)")
    ap.add_argument("--bits-only", action="store_true", help="no timing of the products")
    ap.add_argument("--rows", help="comma-separated row counts, the last one the full call")
    ap.add_argument("--no-forced", action="store_true", help="only the picked tiles")
    ap.add_argument("--modes", choices=("both", "plain", "invariant"), default="both",
                    help="the engine check's batch_invariant settings")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.probes:  # the row checks alone
        result = dict(run_info(device=not args.tiny), probes=probes(args.tiny, args.layers))
        (out / "invariance_probes.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result["probes"], indent=1))
        return
    if args.buckets:
        (out / "invariance_buckets.json").write_text(json.dumps(
            dict(run_info(device=not args.tiny), buckets=buckets(args.tiny, args.layers)),
            indent=1))
        return
    if args.sweep:
        (out / "invariance_sweep.json").write_text(json.dumps(
            dict(run_info(device=not args.tiny), sweep=sweep(args.tiny, args.reps)), indent=1))
        return
    result = dict(run_info(device=not args.tiny),
                  products=[] if args.engine_only else products(
                      args.tiny, args.reps, args.shapes and args.shapes.split(","),
                      not args.bits_only, args.rows and [int(r) for r in args.rows.split(",")],
                      not args.no_forced),
                  probes=[] if args.engine_only else probes(args.tiny, args.layers))
    if not args.skip_engine:
        modes = {"both": (False, True), "plain": (False,), "invariant": (True,)}[args.modes]
        result["engine"] = engine(args.tiny, modes)
    (out / "invariance.json").write_text(json.dumps(result, indent=1))
    print("| product | M | bitwise to 8192 rows | XLA: max row diff | ours ms | XLA ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in result["products"]:
        for m, t in r["ms"].items():
            print(f"| {r['name']} {r['k']}x{r['n']} | {m} | {r['rows_bitwise'].get(m, '-')} | "
                  f"{r['xla_rows_max_diff'].get(m, '-')} | {t['invariant']:.4f} | "
                  f"{t['xla']:.4f} | {t['ratio']:.2f} |")
        print(f"  {r['name']}: rel err {r['rel_err']:.1e} (XLA {r['xla_rel_err']:.1e}); forced "
              f"tiles bitwise: {r['forced_bitwise']}; all rows bitwise: "
              f"{all(r['rows_bitwise'].values())}")
    for r in result["probes"] + result.get("engine", []):
        print(r)


if __name__ == "__main__":
    main()
