"""Readers of the published integer weight formats into one form, `IntLinear`.

- AWQ (AutoAWQ GEMM): `qweight` int32 [in, out / 8] (8 columns per word in the order
  0 2 4 6 1 3 5 7), `qzeros` int32 [in / g, out / 8] packed the same way, `scales` [in / g, out].
- GPTQ: `qweight` int32 [in * bits / 32, out] (consecutive input rows per word), `qzeros`
  [groups, out * bits / 32] (stored as zero - 1 unless `checkpoint_format` is gptq_v2),
  `scales` [groups, out], `g_idx` [in] (each input row's group; act order when not monotone).
- compressed-tensors `pack-quantized`: `weight_packed` int32 [out, in * bits / 32] holding
  code + 2**(bits - 1), `weight_scale` [out, groups], `weight_shape`, `weight_zero_point`
  [out * bits / 32, groups] packed along out (asymmetric), `weight_g_idx` (group act order).

Each reader takes a tensor getter and the linear's (in, out) and returns unsigned codes
[in, out] with f32 scales and zeros [groups, out]; a row permutation makes act-order groups
contiguous. Anything that does not fit is a `CheckpointError` naming the tensor or the field.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from .errors import CheckpointError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column of each nibble within a word's 8 columns


@dataclasses.dataclass
class IntLinear:
    """A quantized [in, out] weight: (codes - zero) * scale, one scale/zero per group of
    `group_size` input rows (in the stored, group-sorted order) and column. `zero` None means
    2**(bits - 1). With `perm`, stored row i is input row perm[i]."""
    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None
    bits: int
    group_size: int
    perm: np.ndarray | None = None

    def dequantize(self) -> np.ndarray:
        """The f32 [in, out] weight in the input order."""
        rows = np.arange(self.codes.shape[0]) // self.group_size
        z = 2.0 ** (self.bits - 1) if self.zero is None else self.zero[rows]
        w = (self.codes.astype(np.float32) - z) * self.scale[rows]
        if self.perm is not None:
            w = w[np.argsort(self.perm)]
        return w


@dataclasses.dataclass(frozen=True)
class IntScheme:
    """What a checkpoint's `quantization_config` says about one linear's weight."""
    method: str  # "awq", "gptq" or "compressed-tensors"
    bits: int
    group_size: int  # -1: one group per column
    symmetric: bool = True
    gptq_v2: bool = False
    act_order: bool = False


def _unpack_words(words, bits: int, axis: int) -> np.ndarray:
    """int32 words -> codes, 32 // bits per word, low bits first, expanded along `axis`."""
    per = 32 // bits
    w = np.moveaxis(np.asarray(words).view(np.uint32), axis, -1)
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    codes = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return np.moveaxis(codes.reshape(*w.shape[:-1], -1), -1, axis).astype(np.int32)


def _want(get, name: str, shape: tuple, dtypes=None) -> np.ndarray:
    a = get(name)
    if tuple(a.shape) != tuple(shape):
        raise CheckpointError(f"tensor {name} has shape {tuple(a.shape)}; expected {tuple(shape)}")
    if dtypes and a.dtype not in dtypes:
        raise CheckpointError(f"tensor {name} has dtype {a.dtype}; expected {dtypes}")
    return a


def _groups(scheme: IntScheme, k: int, name: str) -> tuple[int, int]:
    g = k if scheme.group_size in (-1, None) or scheme.group_size >= k else scheme.group_size
    if g <= 0:
        raise CheckpointError(f"{name}: group_size {scheme.group_size} is not supported")
    return g, -(-k // g)


def _act_order(g_idx: np.ndarray, g: int, name: str):
    """The row order that makes each group's rows contiguous, or None if they already are."""
    k = g_idx.shape[0]
    contiguous = np.arange(k) // g
    if np.array_equal(g_idx, contiguous):
        return None
    perm = np.argsort(g_idx, kind="stable")
    if not np.array_equal(g_idx[perm], contiguous):
        raise CheckpointError(f"tensor {name} does not give every group {g} rows "
                              f"(group sizes {np.bincount(g_idx)[:4].tolist()}...)")
    return perm


def _finish(codes, scale, zero, bits, g, perm=None) -> IntLinear:
    if zero is not None and np.all(zero == 2 ** (bits - 1)):
        zero = None  # symmetric: the kernel reads no zeros
    if perm is not None:
        codes = codes[perm]
    return IntLinear(codes.astype(np.uint8), np.asarray(scale, np.float32),
                     None if zero is None else np.asarray(zero, np.float32), bits, g, perm)


def read_awq(get, prefix: str, shape: tuple, scheme: IntScheme) -> IntLinear:
    k, n = shape
    if scheme.bits != 4:
        raise CheckpointError(f"AWQ {prefix}: bits={scheme.bits}; only 4-bit AWQ is supported")
    g, groups = _groups(scheme, k, prefix)
    qw = _want(get, prefix + "qweight", (k, n // 8), (np.int32,))
    qz = _want(get, prefix + "qzeros", (groups, n // 8), (np.int32,))
    scale = _want(get, prefix + "scales", (groups, n))
    order = np.argsort(AWQ_ORDER)  # nibble holding each column
    codes = _unpack_words(qw, 4, 1).reshape(k, n // 8, 8)[:, :, order].reshape(k, n)
    zero = _unpack_words(qz, 4, 1).reshape(groups, n // 8, 8)[:, :, order].reshape(groups, n)
    return _finish(codes, scale, zero, 4, g)


def read_gptq(get, has, prefix: str, shape: tuple, scheme: IntScheme) -> IntLinear:
    k, n = shape
    bits = scheme.bits
    if bits not in (4, 8):
        raise CheckpointError(f"GPTQ {prefix}: bits={bits}; supported: 4, 8")
    g, groups = _groups(scheme, k, prefix)
    per = 32 // bits
    qw = _want(get, prefix + "qweight", (k // per, n), (np.int32,))
    qz = _want(get, prefix + "qzeros", (groups, n // per), (np.int32,))
    scale = _want(get, prefix + "scales", (groups, n))
    codes = _unpack_words(qw, bits, 0)
    zero = _unpack_words(qz, bits, 1) + (0 if scheme.gptq_v2 else 1)
    perm = None
    if has(prefix + "g_idx"):
        g_idx = _want(get, prefix + "g_idx", (k,)).astype(np.int64)
        perm = _act_order(g_idx, g, prefix + "g_idx")
    elif scheme.act_order:
        raise CheckpointError(f"checkpoint lacks tensor {prefix}g_idx, which desc_act=true needs")
    return _finish(codes, scale, zero, bits, g, perm)


def read_compressed(get, has, prefix: str, shape: tuple, scheme: IntScheme) -> IntLinear:
    k, n = shape
    bits = scheme.bits
    if bits not in (4, 8):
        raise CheckpointError(f"compressed-tensors {prefix}: num_bits={bits}; supported: 4, 8")
    g, groups = _groups(scheme, k, prefix)
    per = 32 // bits
    packed = _want(get, prefix + "weight_packed", (n, -(-k // per)), (np.int32,))
    if has(prefix + "weight_shape"):
        stored = tuple(int(v) for v in np.asarray(get(prefix + "weight_shape")).reshape(-1))
        if stored != (n, k):
            raise CheckpointError(f"tensor {prefix}weight_shape is {stored}; expected {(n, k)}")
    scale = _want(get, prefix + "weight_scale", (n, groups)).T
    codes = _unpack_words(packed, bits, 1)[:, :k].T
    zero = None
    if not scheme.symmetric:
        zp = _want(get, prefix + "weight_zero_point", (-(-n // per), groups), (np.int32,))
        zero = _unpack_words(zp, bits, 0)[:n].T
    perm = None
    if has(prefix + "weight_g_idx"):
        g_idx = _want(get, prefix + "weight_g_idx", (k,)).astype(np.int64)
        perm = _act_order(g_idx, g, prefix + "weight_g_idx")
    elif scheme.act_order:
        raise CheckpointError(f"checkpoint lacks tensor {prefix}weight_g_idx, which "
                              "actorder 'group' needs")
    return _finish(codes, scale, zero, bits, g, perm)


# -- quantization_config -------------------------------------------------------------------


def _field(cfg: dict, key: str, allowed, where: str):
    value = cfg.get(key)
    if value not in allowed:
        raise CheckpointError(f"quantization_config {where}{key}={value!r} is not supported; "
                              f"supported: {list(allowed)}")
    return value


def parse_awq(cfg: dict) -> IntScheme:
    version = str(cfg.get("version", "gemm")).lower()
    if version != "gemm":
        raise CheckpointError(f"quantization_config version={version!r} (AWQ) is not "
                              "supported; only the GEMM packing ('gemm') is")
    if cfg.get("zero_point", True) is False:
        raise CheckpointError("quantization_config zero_point=false (AWQ) is not supported")
    return IntScheme("awq", int(_field(cfg, "bits", (4,), "")),
                     int(cfg.get("group_size", 128)), symmetric=False)


def parse_gptq(cfg: dict) -> IntScheme:
    fmt = cfg.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise CheckpointError(f"quantization_config checkpoint_format={fmt!r} (GPTQ) is not "
                              "supported; supported: 'gptq', 'gptq_v2'")
    return IntScheme("gptq", int(_field(cfg, "bits", (4, 8), "")),
                     int(cfg.get("group_size", 128)), bool(cfg.get("sym", True)),
                     gptq_v2=fmt == "gptq_v2", act_order=bool(cfg.get("desc_act", False)))


def parse_compressed_group(cfg: dict, where: str) -> IntScheme:
    w = cfg.get("weights") or {}
    _field(w, "type", ("int",), where + "weights.")
    strategy = _field(w, "strategy", ("group", "channel"), where + "weights.")
    bits = int(_field(w, "num_bits", (4, 8), where + "weights."))
    if cfg.get("input_activations") is not None:
        raise CheckpointError(f"quantization_config {where}input_activations: activation "
                              "quantization is not supported for pack-quantized weights")
    actorder = w.get("actorder")
    if actorder not in (None, False, "group", "weight", "static"):
        raise CheckpointError(f"quantization_config {where}weights.actorder={actorder!r} is "
                              "not supported")
    group = int(w["group_size"]) if strategy == "group" else -1
    return IntScheme("compressed-tensors", bits, group, bool(w.get("symmetric", True)),
                     act_order=actorder == "group")


def _matches(pattern: str, name: str, kind: str = "Linear") -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == kind or pattern == name


class CompressedTensorsConfig:
    """Which linears a compressed-tensors config quantizes, and how."""

    def __init__(self, cfg: dict):
        fmt = cfg.get("format")
        self.groups = []
        for key, group in (cfg.get("config_groups") or {}).items():
            gfmt = group.get("format") or fmt
            if gfmt != "pack-quantized":
                raise CheckpointError(f"quantization_config format={gfmt!r} (config group "
                                      f"{key}) is not supported; supported: 'pack-quantized'")
            scheme = parse_compressed_group(group, f"config_groups.{key}.")
            self.groups.append((group.get("targets") or [], scheme))
        if not self.groups:
            raise CheckpointError("quantization_config has no config_groups")
        self.ignore = list(cfg.get("ignore") or [])

    def scheme_for(self, module: str) -> IntScheme | None:
        if any(_matches(p, module, kind="") for p in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(t, module) for t in targets):
                return scheme
        return None


def read_linear(quant, get, has, module: str, shape: tuple) -> IntLinear | None:
    """The quantized weight of HF module `module` (e.g. model.layers.0.mlp.up_proj) of
    [in, out] `shape`, or None if the checkpoint keeps it in floating point."""
    if isinstance(quant, CompressedTensorsConfig):
        scheme = quant.scheme_for(module)
        return None if scheme is None else read_compressed(get, has, module + ".", shape, scheme)
    if not has(module + ".qweight"):
        return None  # modules_to_not_convert and the lm_head stay in floating point
    reader = read_awq if quant.method == "awq" else (
        lambda get, prefix, shape, scheme: read_gptq(get, has, prefix, shape, scheme))
    return reader(get, module + ".", shape, quant)


def parse_quantization_config(cfg: dict | None):
    """A checkpoint's `quantization_config` -> an IntScheme (AWQ, GPTQ) or a
    CompressedTensorsConfig, or None if it is not an integer weight format."""
    if not cfg:
        return None
    method = cfg.get("quant_method")
    if method == "awq":
        return parse_awq(cfg)
    if method == "gptq":
        return parse_gptq(cfg)
    if method == "compressed-tensors":
        formats = {g.get("format") or cfg.get("format")
                   for g in (cfg.get("config_groups") or {}).values()} or {cfg.get("format")}
        if formats & {"float-quantized", "int-quantized"}:
            return None  # FP8 and INT8 W8A8: read by fp8_checkpoint
        return CompressedTensorsConfig(cfg)
    return None
