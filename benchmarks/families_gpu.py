"""The paged step of real head shapes on the GPU against the dense forward: Llama-3-8B's heads,
Qwen3-8B's (q/k norms in the projection's epilogue), Phi-3-mini's (head dim 96: pages 128
wide, queries and keys padded with zeros), Gemma-3-4B's (norms with plus-one weights, head dim
256: smaller tiles) and Gemma-2-2B's (head dim 256, a soft cap on the scores), two layers each,
random bf16 weights fused as serving holds them.

    python -m benchmarks.families_gpu --out $OUT      # GPU
    python -m benchmarks.families_gpu --tiny          # CPU (does it run)

For each shape: a prompt in one chunk, then three decode steps, through `model.forward` over
freshly poisoned device memory; each step's logits (every prompt token's, then each decode
token's) against `forward_logits` on the unfused weights over the whole sequence, relative
error. Then the device time of a decode step of 64 sequences at 512 keys with the epilogue in
one launch and with XLA's passes (`PALLASITE_ROPE_KV=0`). Writes OUT/families_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common

SHAPES = {  # HF config fields over a two-layer model
    "llama3_8b": dict(model_type="llama", hidden_size=4096, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336),
    "qwen3_8b": dict(model_type="qwen3", hidden_size=4096, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288),
    "phi3_mini": dict(model_type="phi3", hidden_size=3072, num_attention_heads=32,
                      num_key_value_heads=32, intermediate_size=8192),
    "gemma3_4b": dict(model_type="gemma3_text", hidden_size=2560, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, intermediate_size=10240,
                      query_pre_attn_scalar=256, sliding_window=512,
                      layer_types=["sliding_attention", "full_attention"]),
    "gemma2_2b": dict(model_type="gemma2", hidden_size=2304, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, intermediate_size=9216,
                      query_pre_attn_scalar=256, sliding_window=4096,
                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
}
TINY = dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)


def batch_of(lens, new, page_size, pages_each):
    """A Batch for sequences of context `lens` taking their last `new` tokens each, pages
    [s * pages_each ...] in order; logits at every new token."""
    from pallasite.model import Batch
    starts = np.concatenate([[0], np.cumsum(new)])
    slots = np.concatenate([s * pages_each * page_size + np.arange(n - k, n)
                            for s, (n, k) in enumerate(zip(lens, new))])
    table = np.arange(len(lens) * pages_each).reshape(len(lens), pages_each)
    return Batch(*(jnp.asarray(np.asarray(a), jnp.int32) for a in (
        starts, lens, table, slots, np.arange(starts[-1]))))


def check(name, fields, args):
    from pallasite.model import (config_from_dict, forward, forward_logits, init_kv_cache,
                                 init_params)
    from pallasite.model.fuse import fuse_params
    config = config_from_dict(dict(vocab_size=32000, num_hidden_layers=2, rms_norm_eps=1e-6,
                                   max_position_embeddings=8192,
                                   **(fields | (TINY if args.tiny else {}))))
    params = jax.jit(lambda: init_params(config, 0, jnp.bfloat16))()
    rng = np.random.default_rng(0)
    n, page_size = (24 if args.tiny else 200), 16
    seq = rng.integers(0, config.vocab_size, n + 3)
    dense = np.asarray(jax.jit(lambda p, t: forward_logits(p, config, t))(params, seq[None]))[0]
    fused = fuse_params(jax.tree.map(jnp.copy, params))
    step = jax.jit(lambda p, t, pos, kv, b: forward(p, config, t, pos, kv, b), donate_argnums=3)
    if not args.tiny:
        common.poison()
    pages_each = -(-(n + 3) // page_size)
    kv = init_kv_cache(config, pages_each, page_size, jnp.bfloat16)
    errs = []
    for a, b in ((0, n), (n, n + 1), (n + 1, n + 2), (n + 2, n + 3)):
        batch = batch_of(np.asarray([b]), np.asarray([b - a]), page_size, pages_each)
        logits, kv = step(fused, jnp.asarray(seq[a:b], jnp.int32),
                          jnp.arange(a, b, dtype=jnp.int32), kv, batch)
        errs.append(common.rel_err(logits, dense[a:b]))
    rec = dict(common.run_info(device=not args.tiny), shape=name, head_dim=config.head_dim,
               page_head_dim=config.page_head_dim, qk_norm=config.qk_norm,
               rel_err_prefill=errs[0], rel_err_decode=max(errs[1:]))
    print(f"{name}: head dim {config.head_dim} (pages {config.page_head_dim}), prefill "
          f"rel err {errs[0]:.2e}, decode {max(errs[1:]):.2e}", flush=True)
    if not args.tiny:
        rec.update(decode_ms(config, fused, args))
    return rec


def decode_ms(config, params, args):
    """Device time of a 64-row decode step at 512 keys, epilogue kernel against XLA's passes."""
    from pallasite.model import forward, init_kv_cache
    rows, ctx, page_size = 64, 512, 16
    batch = batch_of(np.full(rows, ctx), np.ones(rows, int), page_size, ctx // page_size)
    tokens = jnp.zeros(rows, jnp.int32)
    positions = jnp.full(rows, ctx - 1, jnp.int32)
    out = {}
    for name, flag in (("epilogue", "1"), ("xla_passes", "0")):
        os.environ["PALLASITE_ROPE_KV"] = flag  # read while tracing: one program each
        kv = init_kv_cache(config, rows * ctx // page_size, page_size, jnp.bfloat16)
        out[f"decode64_ms_{name}"] = common.device_ms(
            lambda kv, p, t, pos, b: forward(p, config, t, pos, kv, b)[1], kv, params, tokens,
            positions, batch, reps=args.reps, chain=True)
    os.environ.pop("PALLASITE_ROPE_KV")
    print(f"  decode step, 64 rows at {ctx} keys: epilogue {out['decode64_ms_epilogue']:.3f} ms,"
          f" XLA's passes {out['decode64_ms_xla_passes']:.3f} ms", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    print(json.dumps(common.run_info(device=not args.tiny) | dict(command=common.command())),
          flush=True)
    records = []
    for name in args.shapes.split(","):
        records.append(check(name, SHAPES[name], args))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "families_gpu.json"), "w") as f:
            json.dump(records, f, indent=1)
    return records


if __name__ == "__main__":
    main()
