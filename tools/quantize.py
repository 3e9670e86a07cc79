"""`pallasite quantize`: write an INT4 or INT8 weight-only compressed-tensors folder
(`pack-quantized`, the format llm-compressor writes and vLLM loads), or an INT8 W8A8 one
(`int-quantized`, `--method smoothquant`), from a float checkpoint.

    pallasite quantize MODEL OUT [--method rtn|awq|gptq|smoothquant] [--bits 4|8]
                      [--group-size 128] [--asymmetric] [--alpha 0.5] [--calibration FILE]
                      [--samples 16] [--seq-len 512] [--no-act-order] [--no-clip]
                      [--no-sequential]

Calibration runs the model's own layers (JAX, any backend) on a small text (a bundled one, or
a file given) and takes each linear's input activations. Layer by layer: each layer sees the
outputs of the layers before it as quantized (`--no-sequential`: as float), and its own
linears' inputs from its float weights:
- rtn: round to nearest, no calibration;
- awq: per input channel, the scale s = mean|x|**alpha (alpha searched on a grid) that
  minimizes the output error of (x / s) @ Q(w * s); 1 / s is folded into the norm before q/k/v
  and gate/up, into v for o (only when there is one kv head per query head, as in AutoAWQ) and
  into up for down; then, but for q and k, each group's clipping bound searched the same way;
- gptq: each weight row (input channel) quantized in turn, its rounding error spread over the
  rows not yet quantized through the Cholesky factor of the inverse Hessian X^T X; the rows in
  activation order (falling X^T X diagonal), the groups' parameters fixed from the weight, so
  the folder keeps the in-order form (actorder "weight");
- smoothquant: W8A8, symmetric INT8 weights per output channel with INT8 activations quantized
  per token at run time; before that, per input channel s = max|x|**alpha / max|w|**(1-alpha)
  with 1 / s folded into the norm before q/k/v and gate/up and into up for down (llm-compressor's
  mappings), so activation outliers move into the weights.
Embeddings, norms and the lm_head stay in floating point (the `ignore` list names lm_head).
MoE models (EXPERTS: Mixtral, Qwen3-MoE; weight-only) quantize every expert as its own module,
calibrated on the rows routed to it; the router stays float (and in `ignore`).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
LINEARS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
           "down": ("mlp.down_proj",)}
# MoE families whose experts are plain SwiGLU MLPs stored one module an expert: the block's
# name, its experts' gate, up and down names, and the router (kept in floating point).
EXPERTS = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), r"re:.*block_sparse_moe\.gate$"),
           "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), r"re:.*mlp\.gate$")}


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("model", help="Hugging Face checkpoint folder (float weights)")
    p.add_argument("out", help="folder to write the quantized checkpoint into")
    p.add_argument("--method", choices=["rtn", "awq", "gptq", "smoothquant"], default="awq")
    p.add_argument("--bits", type=int, choices=[4, 8], default=None,
                   help="weight bits: 4 (default) or 8; smoothquant is always 8")
    p.add_argument("--alpha", type=float, default=0.5,
                   help="smoothquant: how much of the activations' range moves into the weights")
    p.add_argument("--group-size", type=int, default=128,
                   help="input rows per scale, a multiple of 32; -1: one scale per output channel")
    p.add_argument("--asymmetric", action="store_true", help="zero points (default symmetric)")
    p.add_argument("--calibration", default=None,
                   help="a text file to calibrate on (default: a bundled English text)")
    p.add_argument("--samples", type=int, default=16, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=None,
                   help="gptq: quantize rows in activation order (default on); the groups and "
                        "the stored form stay in order")
    p.add_argument("--clip", action=argparse.BooleanOptionalAction, default=True,
                   help="awq: search each group's clipping bound (default on)")
    p.add_argument("--sequential", action=argparse.BooleanOptionalAction, default=True,
                   help="calibrate each layer on the quantized layers' outputs (default on), "
                        "not the float model's")


def run(args) -> int:
    from pallasite.model import CheckpointError, ConfigError
    text = Path(args.calibration).read_text() if args.calibration else None
    w8a8 = args.method == "smoothquant"
    if w8a8 and args.bits not in (None, 8):
        raise SystemExit("pallasite quantize: --method smoothquant writes 8-bit weights, not "
                         f"--bits {args.bits}")
    bits = 8 if w8a8 else args.bits or 4
    try:
        report = quantize(args.model, args.out, method=args.method, bits=bits,
                          group_size=-1 if w8a8 else args.group_size,
                          symmetric=w8a8 or not args.asymmetric, text=text,
                          samples=args.samples, seq_len=args.seq_len, alpha=args.alpha,
                          act_order=args.act_order, clip=args.clip,
                          sequential=args.sequential)
    except (CheckpointError, ConfigError, ValueError) as e:
        raise SystemExit(f"pallasite quantize: {e}") from None
    err = np.mean([r["rel_err"] for r in report["linears"]])
    what = "W8A8 per channel" if w8a8 else f"W{bits}A16 group {args.group_size}"
    print(f"wrote {args.out}: {len(report['linears'])} linears, {args.method} {what}, mean "
          f"relative output error {err:.4f} on the calibration activations", file=sys.stderr)
    return 0


def calibration_tokens(model_dir: Path, text: str | None, samples: int, seq_len: int):
    """[n, T] token ids cut from the text (repeated if it is short)."""
    from pallasite.model.tokenizer import Tokenizer
    if not (model_dir / "tokenizer.json").exists():
        raise ValueError(f"no tokenizer.json in {model_dir}: calibration needs the tokenizer")
    ids = Tokenizer.from_pretrained(model_dir).encode(text or CALIBRATION_TEXT.read_text())
    if not ids:
        raise ValueError("the calibration text is empty")
    need = samples * seq_len
    ids = (ids * -(-need // len(ids)))[:need]
    return np.asarray(ids, np.int32).reshape(samples, seq_len)


@functools.partial(jax.jit, static_argnums=0)
def layer_output(config, lp, x, positions):
    """One decoder layer's output (the next layer's input)."""
    from pallasite.model.transformer import Block, residual_sum
    return residual_sum(*Block(config, x.dtype).apply({"params": lp}, x, positions)[:2])


@functools.partial(jax.jit, static_argnums=0)
def _layer_inputs(config, lp, x, positions):
    from pallasite.model.attention import Attention, attend
    from pallasite.model.layers import RMSNorm
    c, dt = config, x.dtype
    norm = lambda p, v: RMSNorm(c.hidden_size, c.rms_norm_eps, dt).apply({"params": p}, v)
    xn = norm(lp["attn_norm"], x)
    q, k, v = Attention(c, dt).apply({"params": lp["attn"]}, xn, positions,
                                     method=lambda m, a, p: m.qkv(a, p))
    o_in = attend(q, k, v)[0]
    h = x + jnp.einsum("...hk,hkd->...d", o_in, lp["attn"]["wo"])
    xm = norm(lp["mlp_norm"], h)
    out = layer_output(c, lp, x, positions)
    if "moe" in lp:  # the experts' input and each token's routed experts
        from pallasite.model.layers import route_tokens
        experts = route_tokens(c, xm.reshape(-1, xm.shape[-1]), lp["moe"]["router"])[1]
        return {"qkv": xn, "o": o_in, "experts": xm, "routed": experts}, out
    mlp = lp["mlp"]
    d_in = jax.nn.silu(xm @ mlp["w_gate"]) * (xm @ mlp["w_up"])
    return {"qkv": xn, "o": o_in, "gate_up": xm, "down": d_in}, out


def layer_inputs(config, lp, x, positions):
    """The input activations of one layer's linears (flattened to [n, K]) and its output."""
    acts, out = _layer_inputs(config, lp, x, positions)
    flat = lambda a: np.asarray(a, np.float32).reshape(x.shape[0] * x.shape[1], -1)
    return {k: np.asarray(a) if k == "routed" else flat(a) for k, a in acts.items()}, out


def _quantize_set(method, x, ws, names, bits, g, symmetric, act_order, clip):
    """Quantize weights [K, N] sharing input x (already multiplied by AWQ's s, if any):
    per weight (dequantized, scale, zero). GPTQ with no input rows (an expert no calibration
    token reached) rounds to nearest; AWQ clips each weight first, but q and k, whose errors
    the attention scores multiply rather than add (as AutoAWQ leaves them)."""
    from pallasite.tools import calibration as cal
    kw = dict(bits=bits, group_size=g, symmetric=symmetric)
    xs = jnp.asarray(x)
    h = xs.T @ xs if len(x) and method in ("awq", "gptq") else None
    out = []
    for w, name in zip(ws, names):
        w = jnp.asarray(w)
        if method == "gptq" and h is not None:
            out.append(cal.gptq(w, h, act_order=act_order, **kw))
            continue
        scores = name.endswith(("q_proj", "k_proj"))
        if clip and method == "awq" and h is not None and not scores:
            w = cal.awq_clip(w, h, **kw)
        out.append(cal.rtn(w, **kw))
    return [tuple(np.asarray(a, np.float32) for a in o) for o in out]


def smooth_scales(hf, p, acts, alpha) -> dict:
    """SmoothQuant's factors for the sets whose 1 / s folds into a norm or into up."""
    from pallasite.tools import calibration as cal
    return {key: np.asarray(cal.smoothquant_scales(
        jnp.asarray(acts[key]), [jnp.asarray(hf[p + n + ".weight"].T) for n in LINEARS[key]],
        alpha)) for key in ("qkv", "gate_up", "down")}


def per_token_int8(x):
    """x as the W8A8 product sees it: quantized to INT8 per row and back."""
    from pallasite.kernels.quant_reference import quantize_rows_int8
    xq, xs = quantize_rows_int8(jnp.asarray(x))
    return np.asarray(xq, np.float32) * np.asarray(xs)


def awq_scales(config, hf, p, acts, bits, group_size, symmetric, sets=None) -> dict:
    """AWQ's search for each linear set of one layer (o only where 1 / s can go into v).
    `sets`: key -> module names, LINEARS by default."""
    from pallasite.tools import calibration as cal
    out = {}
    for key, names in (sets or LINEARS).items():
        if (key == "o" and config.num_kv_heads != config.num_heads) or not len(acts[key]) \
                or key.startswith("gate_up."):  # an expert's gate/up take the shared scale
            continue
        ws = [jnp.asarray(hf[p + n + ".weight"].T) for n in names]
        g = ws[0].shape[0] if group_size == -1 else group_size
        out[key] = np.asarray(cal.awq_search(jnp.asarray(acts[key]), ws, bits=bits,
                                             group_size=g, symmetric=symmetric)[0])
    return out


def expert_sets(config, hf, p, acts) -> tuple[dict, dict]:
    """One MoE layer's linear sets beside attention's, and each set's input rows: all the
    experts' gate and up share the norm's output (one AWQ scale, folded into the norm, as
    AutoAWQ does); each expert's down takes the SwiGLU of the rows routed to it, from the
    float weights (its own scale, folded into its up). Each expert's gate/up quantize on its
    routed rows alone (its GPTQ Hessian), under the key "gate_up.E"."""
    from pallasite.kernels.reference import silu_glu
    block, (gate, up, down), _ = EXPERTS[config.model_type]
    name = lambda e, n: f"{block}.experts.{e}.{n}"
    sets = {k: LINEARS[k] for k in ("qkv", "o")}
    sets["gate_up"] = tuple(name(e, n) for e in range(config.num_experts) for n in (gate, up))
    inputs = {k: acts[k] for k in ("qkv", "o")} | {"gate_up": acts["experts"]}
    for e in range(config.num_experts):
        x = acts["experts"][np.flatnonzero((acts["routed"] == e).any(axis=1))]
        w = lambda n: hf[f"{p}{name(e, n)}.weight"].T
        sets[f"gate_up.{e}"], sets[f"down.{e}"] = (name(e, gate), name(e, up)), (name(e, down),)
        inputs[f"gate_up.{e}"] = x
        inputs[f"down.{e}"] = np.asarray(silu_glu(x @ w(gate), x @ w(up)))
    return sets, inputs


def quantize(model_dir, out_dir, *, method="awq", bits=4, group_size=128, symmetric=True,
             text=None, samples=16, seq_len=512, progress=True, alpha=0.5, act_order=None,
             clip=True, sequential=True) -> dict:
    """Quantize every decoder linear; write the folder; return per-linear errors (for
    smoothquant, with the activations quantized per token as they will be).
    `act_order` (GPTQ; on by default): rows in activation order. `clip` (AWQ): the clipping
    search. `sequential`: each layer calibrates on the outputs of the layers before it as
    quantized, not as float."""
    w8a8 = method == "smoothquant"
    if act_order and method != "gptq":
        raise ValueError(f"quantize: act order is GPTQ's, not {method}'s")
    act_order = method == "gptq" if act_order is None else act_order
    if w8a8 and (bits, group_size, symmetric) != (8, -1, True):
        raise ValueError("quantize: smoothquant is 8-bit symmetric per output channel")
    from pallasite.model import load_hf
    from pallasite.train.export import hf_tensors
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config, params = load_hf(model_dir, dtype=jnp.float32)
    if config.is_moe and (w8a8 or config.model_type not in EXPERTS):
        raise ValueError(f"quantize: {'W8A8 ' if w8a8 else ''}mixture-of-experts models "
                         f"({config.model_type}) are not supported (weight-only: "
                         f"{', '.join(EXPERTS)})")
    if group_size != -1 and (group_size % 32 or group_size <= 0):
        raise ValueError(f"quantize: --group-size {group_size} must be -1 or a multiple of 32")
    hf = hf_tensors(params, config)
    if method == "rtn" and not (model_dir / "tokenizer.json").exists():
        tokens = np.arange(seq_len, dtype=np.int32)[None] % config.vocab_size  # errors only
    else:
        tokens = calibration_tokens(model_dir, text, samples, seq_len)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = params["embed"][jnp.asarray(tokens)]
    quantized, report = {}, []
    layers = range(config.num_layers)
    if progress:
        from rich.progress import track
        layers = track(layers, description=f"{method} W{bits}", transient=True)
    for i in layers:
        acts, out = layer_inputs(config, params[f"layers_{i}"], x, positions)
        p = f"model.layers.{i}."
        sets = None
        if "routed" in acts:
            sets, acts = expert_sets(config, hf, p, acts)
        scales = awq_scales(config, hf, p, acts, bits, group_size, symmetric, sets) \
            if method == "awq" else smooth_scales(hf, p, acts, alpha) if w8a8 else {}
        for key, s in scales.items():
            fold_scales(hf, p, key, s, (sets or LINEARS)[key])
        for key, names in (sets or LINEARS).items():
            if sets and key == "gate_up":
                continue  # quantized expert by expert, on each one's routed rows
            ws = [hf[p + n + ".weight"].T for n in names]  # [K, N], after the folds
            k = ws[0].shape[0]
            g = k if group_size == -1 else group_size
            if k % g:
                raise ValueError(f"quantize: {p + names[0]} has {k} inputs, not a multiple of "
                                 f"--group-size {g}")
            s = scales.get("gate_up" if key.startswith("gate_up.") else key)
            xin = acts[key] if s is None else acts[key] / s
            outs = _quantize_set(method, xin, ws if s is None else [w * s[:, None] for w in ws],
                                 names, bits, g, symmetric, act_order, clip)
            x_run = per_token_int8(xin) if w8a8 else xin
            for n, w, (deq, scale, zero) in zip(names, ws, outs):
                quantized[p + n] = (deq, scale, zero, g)
                if not len(xin):  # an expert no calibration token reached
                    continue
                want = acts[key] @ w
                err = float(np.linalg.norm(x_run @ deq - want) /
                            max(np.linalg.norm(want), 1e-30))
                report.append(dict(linear=p + n, rel_err=err))
        x = layer_output(config, quantized_layer(config, i, hf, quantized), x, positions) \
            if sequential else out
    ignore = ["lm_head"] + ([EXPERTS[config.model_type][2]] if config.is_moe else [])
    write_folder(model_dir, out_dir, config, hf, quantized, bits=bits, symmetric=symmetric,
                 group_size=group_size, w8a8=w8a8, ignore=ignore, act_order=act_order)
    return dict(linears=report, method=method, bits=bits, group_size=group_size)


def quantized_layer(config, i, hf, quantized) -> dict:
    """Layer i's params as the written folder will hold them: the folds in `hf`, and each
    quantized linear at its dequantized weight (the next layer's calibration input)."""
    from pallasite.model import hf_sources
    from pallasite.model.loader import _set

    def weight(name):
        module = name.removesuffix(".weight")
        return quantized[module][0].T if module in quantized else hf[name]

    lp = {}
    for path, (names, build) in hf_sources(config).items():
        if path[0] == f"layers_{i}":
            parts = [weight(n) for n in names]
            value = parts[0] if build is None else build(*parts)
            _set(lp, path[1:], jnp.asarray(value, jnp.float32))
    return lp


def fold_scales(hf, p, key, s, names=()):
    """Move AWQ's (or SmoothQuant's) 1 / s into the op before the linear set `names`; the
    set's weights take s. An expert's down folds into that expert's up."""
    if key == "qkv":
        hf[p + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"] / s
    elif key == "gate_up":
        hf[p + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"] / s
        if names and ".experts." in names[0]:  # the router reads that norm too: it takes s
            router = p + names[0].split(".experts.")[0] + ".gate.weight"
            hf[router] = hf[router] * s[None, :]
    elif key.startswith("down"):
        up = p + ("mlp.up_proj" if key == "down" else _expert_up(names[0])) + ".weight"
        hf[up] = hf[up] / s[:, None]
    elif key == "o":
        v = p + "self_attn.v_proj.weight"
        hf[v] = hf[v] / s[:, None]


def _expert_up(down: str) -> str:
    """An expert's up module from its down module's name."""
    for block, (_, up, dn), _ in EXPERTS.values():
        if down.startswith(block + ".experts.") and down.endswith("." + dn):
            return down[:-len(dn)] + up
    raise ValueError(f"quantize: no up projection known for {down}")


def pack_along_last(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes [..., L] -> int32 [..., ceil(L * bits / 32)], low bits first (the
    library's dense packing, for 4 and 8 bits; L padded with zeros)."""
    per = 32 // bits
    pad = -values.shape[-1] % per
    v = np.pad(values.astype(np.uint32), [(0, 0)] * (values.ndim - 1) + [(0, pad)])
    v = v.reshape(*v.shape[:-1], -1, per)
    words = np.zeros(v.shape[:-1], np.uint32)
    for i in range(per):
        words |= v[..., i] << np.uint32(bits * i)
    return words.view(np.int32)


def compressed_tensors(deq, scale, zero, g, bits, symmetric) -> dict:
    """One linear's pack-quantized tensors (HF [out, in] orientation) from its dequantized
    [K, N] weight and group scale / zero [K/G, N] (zero: unsigned code of 0)."""
    rows = np.arange(deq.shape[0]) // g
    codes = np.clip(np.rint(deq / scale[rows] + zero[rows]), 0, 2 ** bits - 1)
    out = {"weight_packed": pack_along_last(codes.T, bits),
           "weight_scale": np.ascontiguousarray(scale.T, np.float32),
           "weight_shape": np.asarray(codes.T.shape, np.int32)}
    if not symmetric:  # signed zero points packed along the outputs: unsigned zero codes
        out["weight_zero_point"] = np.ascontiguousarray(pack_along_last(zero, bits).T)
    return out


def int_quantized(deq, scale) -> dict:
    """One linear's W8A8 tensors (HF [out, in]): int8 values and a [out, 1] scale."""
    codes = np.clip(np.rint(deq / scale), -127, 127).astype(np.int8)
    return {"weight": np.ascontiguousarray(codes.T),
            "weight_scale": np.ascontiguousarray(scale.T, np.float32)}


def quantization_config(bits, group_size, symmetric, w8a8=False, ignore=("lm_head",),
                        act_order=False) -> dict:
    try:
        from compressed_tensors import __version__ as version
    except ImportError:
        version = "0.10.0"
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size, "dynamic": False,
               "actorder": "weight" if act_order else None, "observer": "minmax",
               "block_structure": None}
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
            "dynamic": True, "group_size": None, "observer": None,
            "block_structure": None, "actorder": None} if w8a8 else None
    fmt = "int-quantized" if w8a8 else "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "version": version,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts, "output_activations": None,
                                          "format": fmt}},
            "ignore": list(ignore), "kv_cache_scheme": None}


def write_folder(model_dir, out_dir, config, hf, quantized, *, bits, symmetric, group_size,
                 w8a8=False, ignore=("lm_head",), act_order=False):
    from safetensors.flax import save_file
    raw = json.loads((model_dir / "config.json").read_text())
    dtype = {"float16": jnp.float16, "float32": jnp.float32}.get(
        raw.get("torch_dtype") or raw.get("dtype"), jnp.bfloat16)
    tensors = {name: jnp.asarray(a, dtype) for name, a in hf.items()
               if name.removesuffix(".weight") not in quantized}
    for module, (deq, scale, zero, g) in quantized.items():
        parts = int_quantized(deq, scale) if w8a8 else compressed_tensors(deq, scale, zero, g,
                                                                           bits, symmetric)
        for key, a in parts.items():
            tensors[f"{module}.{key}"] = jnp.asarray(a)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    raw["quantization_config"] = quantization_config(bits, group_size, symmetric, w8a8, ignore,
                                                     act_order)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "special_tokens_map.json", "chat_template.jinja"):
        if (model_dir / name).is_file() and (model_dir / name).resolve() != (out_dir / name):
            shutil.copyfile(model_dir / name, out_dir / name)
