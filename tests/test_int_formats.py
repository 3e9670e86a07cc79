"""The AWQ, GPTQ and compressed-tensors readers against a plain numpy dequantization of the
same tensors, and the errors broken checkpoints get."""

import numpy as np
import pytest

from pallasite.model import int_formats as f
from pallasite.model.loader import CheckpointError

from int_fixtures import awq_linear, compressed_linear, ct_config, gptq_linear

K, N = 256, 64
P = "model.layers.0.mlp.up_proj"


def read(quant, tensors, shape=(K, N)):
    return f.read_linear(quant, tensors.__getitem__, tensors.__contains__, P, shape)


@pytest.mark.parametrize("g", [32, 64, 128])
def test_awq(g):
    tensors, w = awq_linear(np.random.default_rng(g), P + ".", K, N, g)
    lin = read(f.parse_awq({"quant_method": "awq", "bits": 4, "group_size": g,
                            "version": "GEMM"}), tensors)
    assert lin.bits == 4 and lin.group_size == g and lin.zero is not None
    np.testing.assert_allclose(lin.dequantize(), w, rtol=1e-6)


@pytest.mark.parametrize("g,bits,sym,act", [(-1, 4, True, False), (32, 4, False, False),
                                            (64, 4, True, True), (128, 4, False, True),
                                            (128, 8, True, False)])
def test_gptq(g, bits, sym, act):
    tensors, w = gptq_linear(np.random.default_rng(bits + abs(g)), P + ".", K, N, g, bits, sym, act)
    scheme = f.parse_gptq({"quant_method": "gptq", "bits": bits, "group_size": g, "sym": sym,
                           "desc_act": act})
    lin = read(scheme, tensors)
    assert (lin.zero is None) == sym and (lin.perm is not None) == act
    np.testing.assert_allclose(lin.dequantize(), w, rtol=1e-6)


@pytest.mark.parametrize("bits,g,sym,strategy,act", [
    (4, 128, True, "group", False), (4, 32, False, "group", False),
    (4, 64, True, "group", True), (8, -1, True, "channel", False),
    (8, 64, False, "group", False), (4, -1, False, "channel", False)])
def test_compressed_tensors(bits, g, sym, strategy, act):
    tensors, w = compressed_linear(np.random.default_rng(bits * abs(g)), P + ".", K, N, g, bits, sym,
                                   act)
    quant = f.parse_quantization_config(ct_config(bits, g, sym, strategy,
                                                  actorder="group" if act else None))
    lin = read(quant, tensors)
    assert lin.bits == bits and (lin.perm is not None) == act
    np.testing.assert_allclose(lin.dequantize(), w, rtol=1e-6)


def test_compressed_tensors_ignore_and_targets():
    cfg = ct_config(ignore=["lm_head", "re:.*down_proj$"])
    cfg["config_groups"]["group_0"]["targets"] = ["re:.*mlp\\..*_proj$"]
    quant = f.parse_quantization_config(cfg)
    assert quant.scheme_for("model.layers.3.mlp.up_proj").bits == 4
    assert quant.scheme_for("model.layers.3.mlp.down_proj") is None  # ignored
    assert quant.scheme_for("model.layers.3.self_attn.q_proj") is None  # not targeted
    assert quant.scheme_for("lm_head") is None


def test_broken_checkpoints_name_the_tensor():
    rng = np.random.default_rng(0)
    tensors, _ = compressed_linear(rng, P + ".", K, N, 128)
    tensors[P + ".weight_scale"] = tensors[P + ".weight_scale"][:, :1]
    with pytest.raises(CheckpointError, match=r"up_proj\.weight_scale has shape \(64, 1\)"):
        read(f.parse_quantization_config(ct_config()), tensors)

    tensors, _ = gptq_linear(rng, P + ".", K, N, 64, act_order=True)
    del tensors[P + ".g_idx"]
    scheme = f.parse_gptq({"quant_method": "gptq", "bits": 4, "group_size": 64,
                           "desc_act": True})
    with pytest.raises(CheckpointError, match=r"lacks tensor .*up_proj\.g_idx"):
        read(scheme, tensors)

    with pytest.raises(CheckpointError, match="num_bits=3"):
        f.parse_quantization_config(ct_config(bits=3))
    with pytest.raises(CheckpointError, match="bits=3"):
        f.parse_gptq({"quant_method": "gptq", "bits": 3, "group_size": 128})
    with pytest.raises(CheckpointError, match="version='gemv'"):
        f.parse_awq({"quant_method": "awq", "bits": 4, "version": "gemv"})

    tensors, _ = awq_linear(rng, P + ".", K, N, 64)
    with pytest.raises(CheckpointError, match=r"up_proj\.qzeros has shape"):
        read(f.parse_awq({"quant_method": "awq", "bits": 4, "group_size": 32}), tensors)
