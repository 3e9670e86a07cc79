"""Writers of AWQ, GPTQ and compressed-tensors linears as each format defines them (the
compressed-tensors packing by the library itself), from random integer codes, and a plain
numpy dequantization of each to compare the readers against."""

import json

import numpy as np
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from safetensors.numpy import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_rows(codes, bits):
    """GPTQ qweight: consecutive input rows in one int32, low bits first. codes [K, N]."""
    per = 32 // bits
    c = codes.astype(np.uint32).reshape(codes.shape[0] // per, per, -1)
    words = np.zeros((c.shape[0], c.shape[2]), np.uint32)
    for i in range(per):
        words |= c[:, i] << np.uint32(bits * i)
    return words.view(np.int32)


def pack_cols(codes, bits, order=None):
    """Columns packed per int32 (GPTQ qzeros; AWQ with its nibble order)."""
    per = 32 // bits
    order = order or tuple(range(per))
    c = codes.astype(np.uint32).reshape(codes.shape[0], -1, per)
    words = np.zeros(c.shape[:2], np.uint32)
    for i in range(per):
        words |= c[:, :, order[i]] << np.uint32(bits * i)
    return words.view(np.int32)


def awq_linear(rng, prefix, k, n, g):
    """AutoAWQ GEMM tensors and the f32 [K, N] weight they mean."""
    q = rng.integers(0, 16, (k, n))
    z = rng.integers(0, 16, (k // g, n))
    s = rng.uniform(0.005, 0.02, (k // g, n)).astype(np.float16)
    tensors = {prefix + "qweight": pack_cols(q, 4, AWQ_ORDER),
               prefix + "qzeros": pack_cols(z, 4, AWQ_ORDER), prefix + "scales": s}
    rows = np.arange(k) // g
    return tensors, (q - z[rows]) * s[rows].astype(np.float32)


def gptq_linear(rng, prefix, k, n, g, bits=4, sym=True, act_order=False):
    """GPTQ (v1: zeros stored minus one) tensors and the f32 [K, N] weight they mean."""
    gs = k if g == -1 else g
    groups = k // gs
    q = rng.integers(0, 2 ** bits, (k, n))
    z = np.full((groups, n), 2 ** (bits - 1)) if sym else rng.integers(1, 2 ** bits, (groups, n))
    s = rng.uniform(0.005, 0.02, (groups, n)).astype(np.float16)
    g_idx = np.arange(k) // gs
    if act_order:
        g_idx = g_idx[rng.permutation(k)]
    tensors = {prefix + "qweight": pack_rows(q, bits), prefix + "qzeros": pack_cols(z - 1, bits),
               prefix + "scales": s, prefix + "g_idx": g_idx.astype(np.int32)}
    return tensors, (q - z[g_idx]) * s[g_idx].astype(np.float32)


def compressed_linear(rng, prefix, k, n, g, bits=4, sym=True, act_order=False):
    """compressed-tensors pack-quantized tensors (HF [out, in]) and the f32 [K, N] weight.
    g=-1: channel strategy."""
    gs = k if g == -1 else g
    groups = k // gs
    lo, hi = -2 ** (bits - 1), 2 ** (bits - 1)
    q = rng.integers(lo, hi, (n, k)).astype(np.int8)
    s = rng.uniform(0.005, 0.02, (n, groups)).astype(np.float16)
    g_idx = np.arange(k) // gs
    if act_order:
        g_idx = g_idx[rng.permutation(k)]
    tensors = {prefix + "weight_packed": pack_to_int32(torch.from_numpy(q), bits).numpy(),
               prefix + "weight_scale": s,
               prefix + "weight_shape": np.asarray([n, k], np.int64)}
    zp = np.zeros((n, groups), np.int8)
    if not sym:
        zp = rng.integers(lo, hi, (n, groups)).astype(np.int8)
        tensors[prefix + "weight_zero_point"] = pack_to_int32(
            torch.from_numpy(zp), bits, packed_dim=0).numpy()
    if act_order:
        tensors[prefix + "weight_g_idx"] = g_idx.astype(np.int32)
    w = (q.astype(np.float32) - zp[:, g_idx]) * s[:, g_idx].astype(np.float32)
    return tensors, w.T


def ct_config(bits=4, g=128, sym=True, strategy="group", ignore=("lm_head",), actorder=None):
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy,
               "group_size": g if strategy == "group" else None, "actorder": actorder}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}},
            "ignore": list(ignore)}


# Writers with groups of 32 and their quantization_config: AWQ, and GPTQ with act order.
GROUP32 = {
    "awq": (lambda rng, p, k, n: awq_linear(rng, p, k, n, 32),
            {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm",
             "zero_point": True}),
    "gptq": (lambda rng, p, k, n: gptq_linear(rng, p, k, n, 32, act_order=True),
             {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
              "sym": True}),
}


def write_pair(float_dir, root, fmt, formats, quantized, seed=0):
    """(quantized folder, its float twin): every linear whose module name `quantized(module)`
    takes is written in `formats[fmt]` (a writer and its quantization_config), the twin holding
    its numpy dequantization; tokenizer files are copied to both."""
    make, quant_cfg = formats[fmt]
    rng = np.random.default_rng(seed)
    base = load_file(float_dir / "model.safetensors")
    raw = json.loads((float_dir / "config.json").read_text())
    quant, twin = dict(base), dict(base)
    for name in sorted(base):
        module = name.removesuffix(".weight")
        if not quantized(module):
            continue
        n, k = base[name].shape
        tensors, w = make(rng, module + ".", k, n)
        del quant[name]
        quant.update(tensors)
        twin[name] = np.ascontiguousarray(w.T, np.float32)
    folders = []
    for sub, tensors, cfg in (("quant", quant, {**raw, "quantization_config": quant_cfg}),
                              ("twin", twin, raw)):
        out = root / f"{fmt}_{sub}"
        out.mkdir()
        save_file(tensors, out / "model.safetensors")
        (out / "config.json").write_text(json.dumps(cfg))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if (float_dir / f).exists():
                (out / f).write_bytes((float_dir / f).read_bytes())
        folders.append(out)
    return folders
