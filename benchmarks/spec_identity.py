"""Is speculation's greedy output different from plain decoding by rounding only, or by a bug?

    python -m benchmarks.spec_identity --out DIR          # GPU (H100: ~2 minutes)
    python -m benchmarks.spec_identity --out DIR --tiny   # CPU check of the script

(a) rows: on one random cache, the first logits row of a verify step (1 + 4 tokens, bucket 8)
    against a plain one-token step in bucket 2 (what bench_speculative compares) and in bucket 8
    (the verify step's own shape), for the default model and a random Llama, in float32 under
    jax.default_matmul_precision("highest") and in bfloat16, with the attention forced to each
    implementation the engine has (PALLASITE_ATTENTION_IMPL=pallas / reference). A correct verify
    step's row 0 sees exactly what the plain step sees: in float32 they agree to ~1e-5; a large
    float32 error is a bug, a bf16-only one is rounding (matrix shapes and split-K order differ).
(b) greedy: the default model, plain against n-gram and draft-model speculation, both with
    `batch_invariant=True` (each row's bits independent of the step around it), on held-out
    prompts, in float32 ("highest") and bfloat16; for each prompt the first differing output
    index, and there the target's own logits (a dense forward of the prompt and the plain
    output so far, same dtype): the top-2 gap and the gap between the two tokens chosen, in
    units of the bf16 spacing at the top logit. A near-tie (under a few spacings) is rounding;
    a wide gap, or any difference in float32, is a bug.

Writes DIR/spec_identity.json and prints both tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.model import config_from_dict, forward_logits, init_params

from .bench_speculative import K, TINY, held_out_documents, prompts_of, step_inputs

RANDOM = dict(model_type="llama", vocab_size=8192, hidden_size=512, intermediate_size=1536,
              num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=2048)
PRECISIONS = {"float32": (jnp.float32, "highest"), "bfloat16": (jnp.bfloat16, None)}


@contextlib.contextmanager
def numerics(precision, impl=None):
    """Matmul precision and the attention implementation while tracing (both read then)."""
    before = os.environ.get("PALLASITE_ATTENTION_IMPL")
    if impl:
        os.environ["PALLASITE_ATTENTION_IMPL"] = impl
    try:
        with (jax.default_matmul_precision(precision) if precision
              else contextlib.nullcontext()):
            yield
    finally:
        if before is None:
            os.environ.pop("PALLASITE_ATTENTION_IMPL", None)
        else:
            os.environ["PALLASITE_ATTENTION_IMPL"] = before


def first_row(config, params, kv, context, buckets, draft):
    """Row 0 of one compiled step (forward only) on a copy of the cache `kv`."""
    from pallasite.serving.engine import Engine
    spec = {"method": "ngram", "num_speculative_tokens": K} if draft else None
    engine = Engine(config, params, num_pages=context // 16 + 8, page_size=16, max_num_seqs=1,
                    max_num_batched_tokens=8, max_model_len=context + 16, token_buckets=buckets,
                    speculative_config=spec)
    engine.state = (jax.tree.map(jnp.copy, kv), *engine.state[1:])
    ints, _, _, key, _ = step_inputs(engine, context, [7] * K if draft else [])
    exe = engine._compile_now(key)
    logits, _ = exe(engine.params, engine.state[0], engine.state[1], ints)
    return np.asarray(logits[0], np.float64), key[0]


def compare(a, b) -> dict:
    top = np.sort(a)[-2:]
    return dict(rel_err=float(np.max(np.abs(a - b)) / (np.max(np.abs(a)) + 1e-30)),
                bitwise=bool(np.array_equal(a, b)), argmax_same=bool(a.argmax() == b.argmax()),
                top2_gap=float(top[1] - top[0]))


def rows_part(args) -> list[dict]:
    from pallasite.model import default_model_path, load_hf
    impls = ["pallas", "reference"] if jax.default_backend() == "gpu" else ["reference"]
    models = {"random": config_from_dict(TINY if args.tiny else RANDOM)}
    out = []
    for name in ["default", "random"]:
        for prec, (dtype, matmul) in PRECISIONS.items():
            if name == "default":
                config, params = load_hf(default_model_path(), dtype=dtype)
            else:
                config = models["random"]
                params = jax.jit(lambda: init_params(config, 0, dtype))()
            kv = [tuple(jax.random.normal(jax.random.key(7 * i + j), x.shape, x.dtype)
                        for j, x in enumerate(layer))
                  for i, layer in enumerate(cache_like(config, args.context, dtype))]
            for impl in impls:
                t = time.perf_counter()
                with numerics(matmul, impl):
                    plain2, T2 = first_row(config, params, kv, args.context, [2, 8], False)
                    plain8, T8 = first_row(config, params, kv, args.context, [8], False)
                    verify, Tv = first_row(config, params, kv, args.context, [2, 8], True)
                out.append(dict(model=name, precision=prec, attention=impl,
                                buckets=dict(plain=T2, plain_wide=T8, verify=Tv),
                                verify_vs_plain=compare(plain2, verify),
                                verify_vs_plain_same_bucket=compare(plain8, verify),
                                plain_bucket_8_vs_2=compare(plain2, plain8),
                                seconds=round(time.perf_counter() - t, 1)))
                print(row_line(out[-1]), flush=True)
    return out


def cache_like(config, context, dtype):
    from pallasite.model import init_kv_cache
    return init_kv_cache(config, context // 16 + 8, 16, dtype)


def row_line(r) -> str:
    f = lambda c: f"{c['rel_err']:.1e}{'=' if c['bitwise'] else ''}{'' if c['argmax_same'] else '!'}"
    return (f"{r['model']:<8} {r['precision']:<9} {r['attention']:<10} "
            f"{f(r['verify_vs_plain']):<12} {f(r['verify_vs_plain_same_bucket']):<12} "
            f"{f(r['plain_bucket_8_vs_2']):<12}")


# -- (b) greedy divergence ----------------------------------------------------------------------
def bf16_spacing(x: float) -> float:
    return float(2.0 ** (np.floor(np.log2(max(abs(x), 1e-30))) - 7))


def generate(llm, prompts, max_tokens):
    from pallasite.serving.llm import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [llm.generate([p], sp)[0].token_ids for p in prompts]


def greedy_part(args) -> list[dict]:
    from pallasite.serving.llm import LLM
    from pallasite.serving.speculative import draft_folder
    methods = {"ngram": {"method": "ngram", "num_speculative_tokens": K,
                         "prompt_lookup_max": 4, "prompt_lookup_min": 1}}
    try:
        draft_folder("default-draft")
        methods["draft"] = {"method": "draft_model", "model": "default-draft",
                            "num_speculative_tokens": K}
    except ValueError as e:
        print(f"draft: skipped ({e})", file=sys.stderr)
    docs = held_out_documents(args.prompts)
    out = []
    for prec, (dtype, matmul) in PRECISIONS.items():
        kw = dict(dtype=dtype, max_num_seqs=1, max_num_batched_tokens=256, max_model_len=1024,
                  token_buckets=[1, K + 1, 256], warmup=False)
        with numerics(matmul):
            # Both batch-invariant (each row's bits independent of the step around it), so
            # that only speculation differs between the two.
            kw["batch_invariant"] = True
            with LLM(**kw) as plain:
                prompts = prompts_of(plain, docs, 64)
                want = generate(plain, prompts, args.max_tokens)
                config, params = plain.config, plain.engine.params
            dense = jax.jit(lambda p, ids: forward_logits(p, config, ids[None])[0, -1])
            for method, spec in methods.items():
                with LLM(speculative_config=spec, **kw) as llm:
                    got = generate(llm, prompts, args.max_tokens)
                for i, (p, w, g) in enumerate(zip(prompts, want, got)):
                    rec = dict(precision=prec, method=method, prompt=i, identical=w == g)
                    if w != g:
                        j = next((j for j, (a, b) in enumerate(zip(w, g)) if a != b),
                                 min(len(w), len(g)))
                        rec.update(first_diff=j)
                        if j < min(len(w), len(g)):
                            logits = np.asarray(dense(params, jnp.asarray(p + w[:j])), np.float64)
                            top = np.sort(logits)[-2:]
                            ulp = bf16_spacing(top[1])
                            rec.update(plain_token=w[j], spec_token=g[j],
                                       top2_gap=float(top[1] - top[0]),
                                       chosen_gap=float(logits[w[j]] - logits[g[j]]),
                                       bf16_spacing=ulp,
                                       top2_gap_in_spacings=float((top[1] - top[0]) / ulp))
                    out.append(rec)
                print(greedy_line(prec, method, out[-len(prompts):]), flush=True)
    return out


def greedy_line(prec, method, recs) -> str:
    bad = [r for r in recs if not r["identical"]]
    gaps = ", ".join(f"#{r['prompt']}@{r['first_diff']}: gap {r.get('top2_gap', float('nan')):.3f}"
                     f" ({r.get('top2_gap_in_spacings', float('nan')):.1f} sp)" for r in bad)
    return f"{prec:<9} {method:<6} identical {len(recs) - len(bad)}/{len(recs)}  {gaps}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU check)")
    ap.add_argument("--context", type=int, default=512, help="tokens in the cache (part a)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    if args.tiny:
        args.context, args.prompts, args.max_tokens = 64, 2, 12
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__)
    print("rows: rel err of row 0 (= bitwise, ! argmax differs)\n"
          f"{'model':<8} {'precision':<9} {'attention':<10} {'verify/plain':<12} "
          f"{'same bucket':<12} {'plain 8/2':<12}", flush=True)
    record["rows"] = rows_part(args)
    print("greedy: first differing index and the target's top-2 logit gap there", flush=True)
    record["greedy"] = greedy_part(args)
    (out / "spec_identity.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
