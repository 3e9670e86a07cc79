"""Published FP8 (and INT8 W8A8) checkpoints, read into the `quant.QArray` layout.

Three forms, told apart by `quantization_config` in config.json:

- `quant_method: "fp8"` (transformers' fine-grained FP8, as DeepSeek-V3 and Qwen3-FP8 ship):
  float8_e4m3fn `weight` [out, in] with float32 `weight_scale_inv` [out / 128, in / 128] for
  `weight_block_size` [128, 128] (the stored value times its block's entry is the weight,
  despite the name), dynamic activations; `modules_to_not_convert` stay in high precision.
  Without `weight_block_size` (AutoFP8's form) the scale is a per-tensor `weight_scale`.
- `quant_method: "compressed-tensors"`, format `float-quantized` (llm-compressor's FP8): each
  config group's `targets` (`Linear`, module names, `re:` patterns) hold 8-bit float weights
  with a `weight_scale` per tensor ([1] / []), per channel ([out, 1]) or per block; `ignore`
  lists modules left in high precision. A static `input_scale` is read and checked; the
  activations are still quantized per token at run time (never coarser than its one scale).
- compressed-tensors `int-quantized` (llm-compressor's W8A8, SmoothQuant's smoothing already
  folded into the weights and norms): symmetric int8 `weight` [out, in] with a per-tensor or
  per-channel `weight_scale`, int8 activations, dynamic per token (or static with an
  `input_scale`, read and checked, then quantized per token as above).

Anything else (other bit widths, group or asymmetric weights, asymmetric activations,
static activation schemes of the fp8 method, other compressed-tensors formats) is a
CheckpointError naming the option. Weights our model keeps in high precision (LM head,
router) are dequantized on load.
"""

from __future__ import annotations

import re

import numpy as np


class FormatError(ValueError):
    """An FP8 checkpoint option this loader does not read (the loader re-raises it as a
    CheckpointError)."""


def _module(weight_name: str) -> str:
    return weight_name.removesuffix(".weight")


class Fp8Format:
    """What one checkpoint's quantization_config says about each tensor. `scheme` is the
    QArray scheme of its weights ("fp8" or "int8"), `stored` their safetensors dtype."""

    def __init__(self, qc: dict):
        method = qc.get("quant_method")
        self.scheme, self.stored = "fp8", "F8_E4M3"
        self.block = None  # (out, in) block, or None: one scale per tensor / channel
        self.targets, self.ignore = ["Linear"], []
        if method == "fp8":
            self.scale_suffix = "weight_scale_inv"
            if qc.get("activation_scheme", "dynamic") != "dynamic":
                raise FormatError(f"fp8 activation_scheme {qc['activation_scheme']!r} is not "
                                  "supported (only 'dynamic')")
            if qc.get("fmt", "e4m3") != "e4m3":
                raise FormatError(f"fp8 fmt {qc['fmt']!r} is not supported (only 'e4m3')")
            if qc.get("weight_block_size") is not None:
                self.block = tuple(int(b) for b in qc["weight_block_size"])
                if len(self.block) != 2:
                    raise FormatError(f"weight_block_size {qc['weight_block_size']} is not "
                                      "[out, in]")
            else:
                self.scale_suffix = "weight_scale"
            self.ignore = list(qc.get("modules_to_not_convert") or [])
        elif method == "compressed-tensors":
            self.scale_suffix = "weight_scale"
            formats = {g.get("format") or qc.get("format")
                       for g in (qc.get("config_groups") or {}).values()} or {qc.get("format")}
            if len(formats) != 1 or not formats <= {"float-quantized", "int-quantized"}:
                raise FormatError(f"compressed-tensors format {sorted(map(str, formats))} is not "
                                  "supported (one of 'float-quantized', 'int-quantized')")
            if formats == {"int-quantized"}:
                self.scheme, self.stored = "int8", "I8"
            if qc.get("quantization_status", "compressed") != "compressed":
                raise FormatError(f"compressed-tensors quantization_status "
                                  f"{qc['quantization_status']!r} is not supported")
            self.targets = []
            for name, group in (qc.get("config_groups") or {}).items():
                self._check_group(name, group)
                self.targets += list(group.get("targets") or [])
            self.ignore = list(qc.get("ignore") or [])
            if qc.get("kv_cache_scheme"):
                raise FormatError("compressed-tensors kv_cache_scheme is not supported")
        else:
            raise FormatError(f"quant_method {method!r} is not supported (supported: 'fp8', "
                              "'compressed-tensors', 'awq', 'gptq')")

    def _check_group(self, name, group):
        w = group.get("weights") or {}
        where = f"compressed-tensors config_groups.{name}"
        kind = "int" if self.scheme == "int8" else "float"
        for key, want in (("num_bits", 8), ("type", kind), ("symmetric", True),
                          ("dynamic", False)):
            if w.get(key, want) != want:
                raise FormatError(f"{where}.weights.{key} = {w.get(key)!r} is not supported "
                                  f"(only {want!r})")
        strategy = w.get("strategy")
        if strategy == "block":
            self.block = tuple(int(b) for b in w.get("block_structure") or ())
            if len(self.block) != 2:
                raise FormatError(f"{where}.weights.block_structure "
                                  f"{w.get('block_structure')} is not [out, in]")
            if kind == "int":
                raise FormatError(f"{where}.weights.strategy 'block' is not supported for int "
                                  "weights (only 'tensor', 'channel')")
        elif strategy not in ("tensor", "channel"):
            raise FormatError(f"{where}.weights.strategy {strategy!r} is not supported "
                              "(only 'tensor', 'channel', 'block')")
        a = group.get("input_activations")
        if a and (a.get("num_bits") != 8 or a.get("type") != kind):
            raise FormatError(f"{where}.input_activations ({a.get('num_bits')}-bit "
                              f"{a.get('type')}) are not supported (only 8-bit {kind})")
        if a and not a.get("symmetric", True):
            raise FormatError(f"{where}.input_activations.symmetric = False is not supported "
                              "(only symmetric activations)")
        if group.get("output_activations"):
            raise FormatError(f"{where}.output_activations are not supported")

    @staticmethod
    def _matches(module: str, patterns) -> bool:
        for p in patterns:
            if p.startswith("re:"):
                if re.match(p[3:], module):
                    return True
            elif module == p or module.endswith("." + p) or p in module.split("."):
                return True
        return False

    def quantized(self, weight_name: str) -> bool:
        """Whether the checkpoint holds this weight in FP8 (a targeted module not ignored)."""
        if not weight_name.endswith(".weight"):
            return False
        module = _module(weight_name)
        if self._matches(module, self.ignore):
            return False
        leaf = module.rsplit(".", 1)[-1]
        is_linear = leaf.endswith("_proj") or leaf in ("w1", "w2", "w3", "lm_head", "gate")
        return (is_linear and "Linear" in self.targets) or self._matches(module, self.targets)

    def scale_name(self, weight_name: str) -> str:
        return f"{_module(weight_name)}.{self.scale_suffix}"

    def input_scale_name(self, weight_name: str) -> str:
        return f"{_module(weight_name)}.input_scale"

    def scale_2d(self, name: str, q_shape, scale: np.ndarray) -> np.ndarray:
        """The HF scale of weight `name` [out, in] as [out / bo, in / bi] float32 (one per block
        of an exact tiling), or FormatError naming the tensor."""
        out, inn = q_shape
        s = np.asarray(scale, np.float32)
        if self.block is not None:
            bo, bi = self.block
            if out % bo or inn % bi:
                raise FormatError(f"{name}: shape {tuple(q_shape)} is not a whole number of "
                                  f"{bo}x{bi} blocks (partial blocks are not supported)")
            want = (out // bo, inn // bi)
        elif s.size == 1:
            want = (1, 1)
        else:
            want = (out, 1)
        if s.size != int(np.prod(want)) or (s.ndim == 2 and s.shape != want) or s.ndim > 2:
            raise FormatError(f"{self.scale_name(name)} has shape {tuple(s.shape)}; weight "
                              f"{name} {tuple(q_shape)} needs {want}")
        if not np.all(np.isfinite(s)) or np.any(s <= 0):
            raise FormatError(f"{self.scale_name(name)} holds non-positive or non-finite scales")
        return s.reshape(want)


def to_param_scale(scale_t: np.ndarray, param_shape, lead: int, in_axes: int) -> np.ndarray:
    """A transposed HF scale [in / bi, out / bo] (after any expert stacking: [E, in/bi, out/bo])
    as a scale of the param's rank. A flat axis whose block does not fit the param's split of
    it (e.g. a 128-block over two 64-wide heads) is repeated to one entry per element there."""
    shape = tuple(param_shape)
    groups = [shape[:lead], shape[lead:lead + in_axes], shape[lead + in_axes:]]
    out = list(scale_t.shape[:lead])
    for axis, sizes in ((lead, groups[1]), (lead + 1, groups[2])):
        n, flat = scale_t.shape[axis], int(np.prod(sizes))
        block = flat // n
        dims, rest = [], block  # fill from the innermost axis outwards
        for size in reversed(sizes):
            if rest >= size and rest % size == 0:
                dims.append(1)
                rest //= size
            elif size % rest == 0:
                dims.append(size // rest)
                rest = 1
            else:
                return None
        out += list(reversed(dims))
    return scale_t.reshape(out)


def expand_flat(scale_t: np.ndarray, axis: int, block: int) -> np.ndarray:
    return np.repeat(scale_t, block, axis=axis)
