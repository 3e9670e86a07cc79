"""The engine's decode step as `profile_step` measures it: a Llama-3-8B-shaped model with random
weights made on the device, the engine compiled for the cases' buckets, a synthetic decode batch
laid out as the engine lays it out, and the step timed synced, pipelined and through
`Engine.step()`."""

from __future__ import annotations

import glob
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

KEEP_GRAPHS = {"xla_enable_command_buffers_during_profiling": True}  # a compile option
PAGE = 16  # tokens per KV page, as the engine and the benchmarks use


def workload(tiny: bool):
    """Model shape and the steps profiled, by name: decode batches (batch, context) and a mixed
    step (prefill chunks of `chunk` tokens each, plus decode rows at a context)."""
    if tiny:
        model = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        return model, dict(b1=(1, 32), b64=(4, 64), b768=(8, 40), mixed=(2, 16, 6, 40),
                           paced=(1, 8, 4, 40), tail=(1, 24, 3, 40, 56),
                           p2k=(1, 64, 0, 0),
                           b8x8k=(2, 128), b32x2k=(4, 64), gen=16, steps=(10, 20),
                           dtype="float32")
    model = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=16384, rope_theta=500000.0)  # b8x8k's 8192 + gen
    # b768 and mixed: ShareGPT-like rows at high concurrency (mean context ~320), the mixed
    # step as the offline run's: 8192 tokens of prefill chunks plus 512 decode rows. b8x8k and
    # b32x2k: a few long conversations (benchmarks/serving_long.py). p2k: one 2048-token
    # prompt in one step, as `benchmarks/bench_quant.py --parts prefill` times it. paced: a
    # step of the paced offline run (scheduler.py): 200 decode rows and a 56-token chunk. tail:
    # one of its last steps: a 247-token chunk of a long prompt (keys to 647) and 9 decode rows.
    return model, dict(b1=(1, 512), b64=(64, 1024), b768=(768, 320), mixed=(30, 256, 512, 320),
                       paced=(1, 56, 200, 400), tail=(1, 247, 9, 500, 647),
                       p2k=(1, 2048, 0, 0),
                       b8x8k=(8, 8192), b32x2k=(32, 2048), gen=256, steps=(30, 60),
                       dtype="bfloat16")


def random_params(config, dtype, seed=0):
    """normal(0.02) matrices and unit norm scales, made on the device one leaf at a time (one
    small compile per distinct shape instead of tracing the whole model's init)."""
    import jax
    import jax.numpy as jnp
    from pallasite.model import param_shapes
    leaves, tree = jax.tree.flatten(param_shapes(config, dtype))
    makers = {}

    def maker(shape):
        if shape not in makers:
            makers[shape] = jax.jit(lambda s: (0.02 * jax.random.normal(
                jax.random.key(s), shape, jnp.float32)).astype(dtype))
        return makers[shape]

    out = [maker(x.shape)(seed + i) if x.ndim > 1 else jnp.ones(x.shape, dtype)
           for i, x in enumerate(leaves)]
    return jax.tree.unflatten(tree, out)


def cases(w, names=("b1", "b64"), min_rows=None):
    """name -> (seqs [(query tokens, context)], (T, P) bucket, first page of its page runs).
    Page tables are as wide as the context plus `gen` tokens for b1/b64 (the batch-1 one as in
    benchmarks/bench_serving.py) and plus 16 for the big steps (their pages must fit)."""
    from pallasite.serving.engine import MIN_TOKEN_BUCKET
    min_rows = min_rows or MIN_TOKEN_BUCKET  # the engine's, for the params (min_token_bucket)
    ps, out, first = PAGE, {}, 1
    for name in names:
        if name in ("mixed", "p2k", "paced", "tail"):  # prefill chunks, and decode rows if any
            n, chunk, rows, ctx, *chunk_ctx = w[name]  # a chunk's keys: its own, or chunk_ctx
            # decode rows first, as the scheduler packs a step
            seqs = [(1, ctx)] * rows + [(chunk, chunk_ctx[0] if chunk_ctx else chunk)] * n
        else:
            batch, ctx = w[name]
            seqs = [(1, ctx)] * batch
        pages = -(-(max(c for _, c in seqs) + (16 if name in ("b768", "mixed") else w["gen"]))
                  // ps)
        T = sum(q for q, _ in seqs)
        T = max(T, min_rows)  # the engine pads a lone token for XLA's bf16 products
        if name == "mixed" and "b768" in out:  # its rows reuse b768's pages: the memory fits
            out[name] = (seqs, (T, out["b768"][1][1]), out["b768"][2])
            continue
        out[name] = (seqs, (T, pages), first)
        first += len(seqs) * pages
    return out


def make_engine(config, params, w, specs, kv_cache_dtype=None):
    """An engine whose buckets hold every case and a one-step prefill of the batch-1 prompt
    (for the `Engine.step()` run), its q/k/v and gate/up fused as `LLM` has them."""
    from pallasite.model.fuse import fuse_params
    from pallasite.serving.engine import Engine
    params = fuse_params(params)
    keys = [k for _, k, _ in specs.values()]
    pages = max(f + len(s) * k[1] for s, k, f in specs.values())
    ctx1 = w["b1"][1]
    rows = max(len(s) for s, _, _ in specs.values())
    ctx = max(c for s, _, _ in specs.values() for _, c in s)
    return Engine(config, params, num_pages=pages + 8, page_size=PAGE, max_num_seqs=rows,
                  max_num_batched_tokens=max([ctx1] + [T for T, _ in keys]),
                  max_model_len=ctx + w["gen"],
                  token_buckets=sorted({T for T, _ in keys} | {ctx1}),
                  page_buckets=sorted({P for _, P in keys}), kv_cache_dtype=kv_cache_dtype)


def compile_all(engine, keys, prefill_key, keep_graphs: bool):
    """Compile (in threads, as `Engine.warmup` does) the decode steps, the prefill step if any
    and the greedy samplers into the engine's own tables, plus each decode step once more with
    command buffers kept under the profiler if asked. Returns {key: that second executable}."""
    keys = keys + ([prefill_key] if prefill_key else [])
    samplers = sorted({(min(T, engine.max_num_seqs), "greedy") for T, _ in keys})
    lowered = {k: engine._lower(k) for k in keys}
    jobs = [(("fwd", k), lo, None) for k, lo in lowered.items()]
    jobs += [(("smp", s), engine._lower_sampler(*s), None) for s in samplers]
    # Lowered again, not shared: two threads compiling one lowering would share its IR.
    jobs += [(("graphs", k), engine._lower(k), KEEP_GRAPHS) for k in keys if keep_graphs
             and k != prefill_key]

    from pallasite.serving.settings import compiler_options

    def compile_one(job):
        try:  # with the engine's own options for the step's size
            tokens = job[0][1][0] if job[0][0] != "smp" else None
            return job[1].compile(compiler_options(tokens) | (job[2] or {}))
        except Exception as e:  # only the optional graph-keeping compile may fail
            if job[0][0] != "graphs":
                raise
            print(f"compile with {job[2]} failed: {e}", flush=True)
            return None

    with ThreadPoolExecutor(min(8, len(jobs))) as pool:
        done = list(pool.map(compile_one, jobs))
    graphs = {}
    for (kind, key), exe in zip([j[0] for j in jobs], done):
        {"fwd": engine._exe, "smp": engine._samplers, "graphs": graphs}[kind][key] = exe
    engine.compilations += len(jobs)
    return {k: v for k, v in graphs.items() if v is not None}


def decode_inputs(engine, batch: int, ctx: int, key, first_page: int, seed=0):
    """`batch` sequences decoding one token each at context `ctx` (`step_inputs`)."""
    return step_inputs(engine, [(1, ctx)] * batch, key, first_page, seed)


def step_inputs(engine, seqs, key, first_page: int, seed=0):
    """The packed int32 inputs of one step, laid out by the engine's `int_layout`: sequence i of
    `seqs` = [(query tokens, context)] on its own run of pages from `first_page`. A one-token
    row decodes, its token read from the device's `last_tokens` (as when the previous step's
    sample is not on the host yet); a longer one is a prefill chunk ending at its context."""
    from pallasite.serving import sampling
    from pallasite.serving.engine import int_layout
    T, P = key
    S, ps, n = min(T, engine.max_num_seqs), engine.page_size, len(seqs)
    q = np.array([a for a, _ in seqs])
    ctx = np.array([c for _, c in seqs])
    row = np.repeat(np.arange(n), q)  # the sequence of each token
    pos = np.concatenate([np.arange(c - a, c) for a, c in seqs])
    table = np.zeros((S, P), np.int32)
    for i, c in enumerate(ctx):
        table[i, :-(-c // ps)] = first_page + i * P + np.arange(-(-c // ps))
    pad = lambda m, v, fill: np.concatenate([v, np.full(m - len(v), fill)])
    decode = q[row] == 1
    starts = np.concatenate([[0], np.cumsum(q)])
    parts = dict(page_table=table.ravel(),
                 tokens=pad(T, np.random.default_rng(seed).integers(0, 100, len(row)), 0),
                 positions=pad(T, pos, 0),
                 kv_slots=pad(T, table[row, pos // ps] * ps + pos % ps, -1),
                 sources=pad(T, np.where(decode, row, -1), -1),
                 query_start=pad(S + 1, starts, starts[-1]),
                 context_lens=pad(S, ctx, 0),
                 logits_indices=pad(S, starts[1:] - 1, 0))
    layout = int_layout(T, S, P)
    assert list(parts) == list(layout), f"the engine's int layout changed: {list(layout)}"
    ints = np.concatenate([parts[k] for k in layout]).astype(np.int32)
    floats, rows = sampling.pack_rows([dict(temperature=0.0)] * n, S)
    sample_ints = np.concatenate([pad(S, np.arange(n), -1), rows.ravel()]).astype(np.int32)
    return ints, sample_ints, floats.ravel()


def make_step(engine, key, inputs, exe=None):
    """One step exactly as `Engine._launch` runs it: forward, greedy sampler, an early copy of
    the result to the host, the device state handed on (donated)."""
    ints, sample_ints, floats = inputs
    exe = exe or engine._exe[key]
    S = min(key[0], engine.max_num_seqs)
    sampler = engine._samplers[(S, "greedy")]

    def step():
        kv, last_tokens, history = engine.state
        logits, kv = engine._forward(exe, kv, last_tokens, ints, S * engine.rows)
        out, last_tokens, history = sampler(logits, last_tokens, history, sample_ints, floats)
        out.copy_to_host_async()
        engine.state = (kv, last_tokens, history)
        return out
    return step


def time_steps(step, n_sync: int, n_pipe: int) -> dict:
    for _ in range(3):
        np.asarray(step())
    synced = []
    for _ in range(n_sync):
        t = time.perf_counter()
        np.asarray(step())
        synced.append(time.perf_counter() - t)
    t = time.perf_counter()
    outs = [step() for _ in range(n_pipe)]
    np.asarray(outs[-1])  # each step waits on the previous one's KV: the last ends last
    pipelined = (time.perf_counter() - t) / n_pipe
    return dict(synced_ms=1e3 * float(np.median(synced)), pipelined_ms=1e3 * pipelined)


def trace_steps(step, n: int, directory: str) -> str:
    """Profile `n` pipelined steps; returns the perfetto trace file JAX wrote."""
    import jax
    np.asarray(step())
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        outs = [step() for _ in range(n)]
        np.asarray(outs[-1])
    found = sorted(glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"),
                             recursive=True), key=os.path.getmtime)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}")
    return found[-1]


def engine_loop(engine, prompt_len: int, tokens: int) -> dict:
    """Batch-1 decode through `Engine.step()` (one-step-ahead overlap on): the median time
    between consecutive decode steps' results, as benchmarks/bench_serving.py measures it."""
    from pallasite.serving.llm import SamplingParams
    prompt = np.random.default_rng(1).integers(0, engine.config.vocab_size, prompt_len).tolist()
    engine.step_log = []
    engine.add_request("profile-b1", prompt, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                            ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    log, engine.step_log = engine.step_log, None
    dts = [b["done"] - a["done"] for a, b in zip(log, log[1:])
           if "done" in a and "done" in b and b["tokens"] == 1]
    return dict(engine_ms=1e3 * float(np.median(dts)), decode_steps=len(dts),
                host_ms_per_step=engine.stats()["host_ms_per_step"])


def step_bytes(params, config, tokens, kv_dtype=None) -> dict:
    """What a step must read: the weights (the embedding table only through its gathered rows,
    unless it is also the output projection) and the K/V of its contexts (`tokens` in all, in
    `kv_dtype`, by default the embedding's)."""
    import jax
    import numpy as np

    from pallasite.model.quant import array_nbytes  # int4 (the int4 tiles): two codes a byte
    layers = sum(array_nbytes(x) for k, v in params.items() if k.startswith("layers_")
                 for x in jax.tree.leaves(v))
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * \
        np.dtype(kv_dtype or params["embed"].dtype).itemsize * tokens
    return dict(layer_weights=layers, lm_head=head.nbytes, kv=kv, total=layers + head.nbytes + kv)
