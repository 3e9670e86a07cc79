"""`pallasite quantize`: write an INT4 or INT8 weight-only compressed-tensors folder
(`pack-quantized`, the format llm-compressor writes and vLLM loads) from a float checkpoint.

    pallasite quantize MODEL OUT [--method rtn|awq|gptq] [--bits 4|8] [--group-size 128]
                      [--asymmetric] [--calibration FILE] [--samples 16] [--seq-len 512]

Calibration runs the model's own layers (JAX, any backend) on a small text (a bundled one, or
a file given) and takes each linear's input activations, from the float model:
- rtn: round to nearest, no calibration;
- awq: per input channel, the scale s = mean|x|**alpha (alpha searched on a grid) that
  minimizes the output error of (x / s) @ Q(w * s); 1 / s is folded into the norm before q/k/v
  and gate/up, into v for o (only when there is one kv head per query head, as in AutoAWQ) and
  into up for down;
- gptq: each weight row (input channel) quantized in turn, its rounding error spread over the
  rows not yet quantized through the Cholesky factor of the inverse Hessian X^T X.
Embeddings, norms and the lm_head stay in floating point (the `ignore` list names lm_head).
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


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("model", help="Hugging Face checkpoint folder (float weights)")
    p.add_argument("out", help="folder to write the quantized checkpoint into")
    p.add_argument("--method", choices=["rtn", "awq", "gptq"], default="awq")
    p.add_argument("--bits", type=int, choices=[4, 8], default=4)
    p.add_argument("--group-size", type=int, default=128,
                   help="input rows per scale, a multiple of 32; -1: one scale per output channel")
    p.add_argument("--asymmetric", action="store_true", help="zero points (default symmetric)")
    p.add_argument("--calibration", default=None,
                   help="a text file to calibrate on (default: a bundled English text)")
    p.add_argument("--samples", type=int, default=16, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence")


def run(args) -> int:
    from pallasite.model import CheckpointError, ConfigError
    text = Path(args.calibration).read_text() if args.calibration else None
    try:
        report = quantize(args.model, args.out, method=args.method, bits=args.bits,
                          group_size=args.group_size, symmetric=not args.asymmetric, text=text,
                          samples=args.samples, seq_len=args.seq_len)
    except (CheckpointError, ConfigError, ValueError) as e:
        raise SystemExit(f"pallasite quantize: {e}") from None
    err = np.mean([r["rel_err"] for r in report["linears"]])
    print(f"wrote {args.out}: {len(report['linears'])} linears, {args.method} W{args.bits}A16 "
          f"group {args.group_size}, mean relative output error {err:.4f} on the calibration "
          f"activations", file=sys.stderr)
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
def _layer_inputs(config, lp, x, positions):
    from pallasite.model.attention import Attention, attend
    from pallasite.model.layers import RMSNorm
    from pallasite.model.transformer import Block
    c, dt = config, x.dtype
    norm = lambda p, v: RMSNorm(c.hidden_size, c.rms_norm_eps, dt).apply({"params": p}, v)
    xn = norm(lp["attn_norm"], x)
    q, k, v = Attention(c, dt).apply({"params": lp["attn"]}, xn, positions,
                                     method=lambda m, a, p: m.qkv(a, p))
    o_in = attend(q, k, v)[0]
    h = x + jnp.einsum("...hk,hkd->...d", o_in, lp["attn"]["wo"])
    xm = norm(lp["mlp_norm"], h)
    mlp = lp["mlp"]
    d_in = jax.nn.silu(xm @ mlp["w_gate"]) * (xm @ mlp["w_up"])
    out, _ = Block(c, dt).apply({"params": lp}, x, positions)
    return {"qkv": xn, "o": o_in, "gate_up": xm, "down": d_in}, out


def layer_inputs(config, lp, x, positions):
    """The input activations of one layer's linears (flattened to [n, K]) and its output."""
    acts, out = _layer_inputs(config, lp, x, positions)
    flat = lambda a: np.asarray(a, np.float32).reshape(x.shape[0] * x.shape[1], -1)
    return {k: flat(a) for k, a in acts.items()}, out


def _quantize_set(method, x, ws, bits, g, symmetric):
    """Quantize weights [K, N] sharing input x (already multiplied by AWQ's s, if any):
    per weight (dequantized, scale, zero)."""
    from pallasite.tools import calibration as cal
    kw = dict(bits=bits, group_size=g, symmetric=symmetric)
    if method == "gptq":
        xs = jnp.asarray(x)
        h = xs.T @ xs
        out = [cal.gptq(jnp.asarray(w), h, **kw) for w in ws]
    else:
        out = [cal.rtn(jnp.asarray(w), **kw) for w in ws]
    return [tuple(np.asarray(a, np.float32) for a in o) for o in out]


def awq_scales(config, hf, p, acts, bits, group_size, symmetric) -> dict:
    """AWQ's search for each linear set of one layer (o only where 1 / s can go into v)."""
    from pallasite.tools import calibration as cal
    out = {}
    for key, names in LINEARS.items():
        if key == "o" and config.num_kv_heads != config.num_heads:
            continue
        ws = [jnp.asarray(hf[p + n + ".weight"].T) for n in names]
        g = ws[0].shape[0] if group_size == -1 else group_size
        out[key] = np.asarray(cal.awq_search(jnp.asarray(acts[key]), ws, bits=bits,
                                             group_size=g, symmetric=symmetric)[0])
    return out


def quantize(model_dir, out_dir, *, method="awq", bits=4, group_size=128, symmetric=True,
             text=None, samples=16, seq_len=512, progress=True) -> dict:
    """Quantize every decoder linear; write the folder; return per-linear errors."""
    from pallasite.model import load_hf
    from pallasite.train.export import hf_tensors
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config, params = load_hf(model_dir, dtype=jnp.float32)
    if config.is_moe:
        raise ValueError(f"quantize: mixture-of-experts models ({config.model_type}) are not "
                         "supported yet")
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
        acts, x = layer_inputs(config, params[f"layers_{i}"], x, positions)
        p = f"model.layers.{i}."
        scales = awq_scales(config, hf, p, acts, bits, group_size, symmetric) \
            if method == "awq" else {}
        for key, s in scales.items():
            fold_awq(hf, p, key, s)
        for key, names in LINEARS.items():
            ws = [hf[p + n + ".weight"].T for n in names]  # [K, N], after the folds
            k = ws[0].shape[0]
            g = k if group_size == -1 else group_size
            if k % g:
                raise ValueError(f"quantize: {p + names[0]} has {k} inputs, not a multiple of "
                                 f"--group-size {g}")
            s = scales.get(key)
            xin = acts[key] if s is None else acts[key] / s
            outs = _quantize_set(method, xin, ws if s is None else [w * s[:, None] for w in ws],
                                 bits, g, symmetric)
            for n, w, (deq, scale, zero) in zip(names, ws, outs):
                want = acts[key] @ w
                err = float(np.linalg.norm(xin @ deq - want) / max(np.linalg.norm(want), 1e-30))
                report.append(dict(linear=p + n, rel_err=err))
                quantized[p + n] = (deq, scale, zero, g)
    write_folder(model_dir, out_dir, config, hf, quantized, bits=bits, symmetric=symmetric,
                 group_size=group_size)
    return dict(linears=report, method=method, bits=bits, group_size=group_size)


def fold_awq(hf, p, key, s):
    """Move AWQ's 1 / s into the op before the linear set; the set's weights take s."""
    if key == "qkv":
        hf[p + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"] / s
    elif key == "gate_up":
        hf[p + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"] / s
    elif key == "down":
        hf[p + "mlp.up_proj.weight"] = hf[p + "mlp.up_proj.weight"] / s[:, None]
    elif key == "o":
        v = p + "self_attn.v_proj.weight"
        hf[v] = hf[v] / s[:, None]


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


def quantization_config(bits, group_size, symmetric) -> dict:
    try:
        from compressed_tensors import __version__ as version
    except ImportError:
        version = "0.10.0"
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size, "dynamic": False,
               "actorder": None, "observer": "minmax", "block_structure": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "version": version,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "output_activations": None,
                                          "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def write_folder(model_dir, out_dir, config, hf, quantized, *, bits, symmetric, group_size):
    from safetensors.flax import save_file
    raw = json.loads((model_dir / "config.json").read_text())
    dtype = {"float16": jnp.float16, "float32": jnp.float32}.get(
        raw.get("torch_dtype") or raw.get("dtype"), jnp.bfloat16)
    tensors = {name: jnp.asarray(a, dtype) for name, a in hf.items()
               if name.removesuffix(".weight") not in quantized}
    for module, (deq, scale, zero, g) in quantized.items():
        for key, a in compressed_tensors(deq, scale, zero, g, bits, symmetric).items():
            tensors[f"{module}.{key}"] = jnp.asarray(a)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    raw["quantization_config"] = quantization_config(bits, group_size, symmetric)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "special_tokens_map.json", "chat_template.jinja"):
        if (model_dir / name).is_file() and (model_dir / name).resolve() != (out_dir / name):
            shutil.copyfile(model_dir / name, out_dir / name)
