"""`pallasite quantize` on a tiny model: the compressed-tensors folder it writes reads back as
the weights it reports, AWQ and GPTQ reconstruct the calibration activations' outputs better
than round-to-nearest (GPTQ better still in activation order, AWQ with its clipping search),
sequential calibration sees the quantized layers, and SmoothQuant's W8A8 folder
(llm-compressor's `int-quantized` form) beats INT8 W8A8 without smoothing and serves."""

import json

import numpy as np
import pytest
import torch
import transformers

import tok_fixtures
from pallasite.model import int_formats
from pallasite.tools import quantize as q


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp")
    tok = tok_fixtures.byte_level(400)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, eos_token_id=tok.token_to_id("<|eos|>"),
        bos_token_id=tok.token_to_id("<|bos|>")))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.15)
        # a few outlier input channels, as trained models have, for AWQ to find
        for layer in model.model.layers:
            layer.input_layernorm.weight[:3] *= 8
            layer.post_attention_layernorm.weight[:3] *= 8
    model.save_pretrained(folder)
    tok_fixtures.save(tok, folder)
    return folder


def run(model_dir, out, method, **kw):
    return q.quantize(model_dir, out, method=method, bits=4, group_size=32, samples=4,
                      seq_len=64, progress=False, **kw)


def test_awq_and_gptq_beat_rtn(model_dir, tmp_path):
    err = {m: np.mean([r["rel_err"] for r in run(model_dir, tmp_path / m, m)["linears"]])
           for m in ("rtn", "awq", "gptq")}
    assert err["awq"] < 0.95 * err["rtn"] and err["gptq"] < 0.9 * err["rtn"], err


def test_gptq_act_order_keeps_the_groups_and_lowers_the_error():
    """In activation order GPTQ keeps every row on its own group's grid (parameters fixed from
    the weight as given) and leaves far less Hessian-weighted error than in order where the
    loudest inputs come last: in order, their rounding falls on no row left to absorb it."""
    import jax.numpy as jnp
    from pallasite.tools import calibration as cal
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 32)) @ rng.normal(size=(32, 128)) + 0.3 * rng.normal(
        size=(512, 128))  # correlated inputs, for the compensation to use
    x[:, -8:] *= 10
    w = rng.normal(size=(128, 48)).astype(np.float32)
    h = jnp.asarray(x.T @ x, jnp.float32)
    kw = dict(bits=4, group_size=32, symmetric=False)
    err = {}
    for act in (False, True):
        deq, scale, zero = cal.gptq(jnp.asarray(w), h, act_order=act, **kw)
        rows = np.arange(128) // 32
        np.testing.assert_allclose(cal.fake_quant(deq, scale[rows], zero[rows], 4), deq,
                                   atol=1e-5)
        e = np.asarray(deq) - w
        err[act] = float(np.trace(e.T @ np.asarray(h) @ e))
    fixed = cal.rtn(jnp.asarray(w), **kw)  # act order: the plain weight's group parameters
    np.testing.assert_array_equal(scale, fixed[1])
    assert err[True] < 0.1 * err[False], err


def test_act_order_and_clipping_lower_the_error(model_dir, tmp_path):
    """On the calibration activations GPTQ in activation order beats it in order, and AWQ's
    clipping search beats AWQ's scales alone; the act-order folder keeps the in-order form
    (compressed-tensors' actorder "weight", no g_idx) and reads back as reported."""
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.numpy import load_file
    err = lambda r: np.mean([x["rel_err"] for x in r["linears"]])
    gptq = {a: err(run(model_dir, tmp_path / f"g{a}", "gptq", act_order=a)) for a in (0, 1)}
    awq = {c: err(run(model_dir, tmp_path / f"a{c}", "awq", clip=c)) for c in (0, 1)}
    assert gptq[1] < 0.9 * gptq[0] and awq[1] < 0.9 * awq[0], (gptq, awq)
    cfg = json.loads((tmp_path / "g1" / "config.json").read_text())["quantization_config"]
    assert QuantizationConfig.model_validate(cfg).config_groups["group_0"].weights.actorder \
        == "weight"
    tensors = load_file(tmp_path / "g1" / "model.safetensors")
    assert not [k for k in tensors if k.endswith("g_idx")]
    with pytest.raises(ValueError, match="act order is GPTQ's, not awq's"):
        run(model_dir, tmp_path / "x", "awq", act_order=True)


def test_cli_writes_gptq_in_act_order_and_names_a_flag_that_does_not_apply(model_dir,
                                                                           tmp_path, capsys):
    from pallasite.cli import main
    args = ["quantize", str(model_dir), str(tmp_path / "cli"), "--group-size", "32",
            "--samples", "2", "--seq-len", "32"]
    assert main(args + ["--method", "gptq"]) == 0
    assert "gptq W4A16 group 32, mean relative output error" in capsys.readouterr().err
    cfg = json.loads((tmp_path / "cli" / "config.json").read_text())["quantization_config"]
    assert cfg["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    with pytest.raises(SystemExit, match="act order is GPTQ's, not rtn's"):
        main(args + ["--method", "rtn", "--act-order"])


def test_sequential_calibration_takes_the_quantized_layers_outputs(tmp_path, monkeypatch):
    """Sequential calibration feeds each layer the outputs of the layers before it as the
    folder holds them: the params it builds are the written folder's, dequantized, and the
    second layer's inputs differ from the float model's."""
    import jax
    import jax.numpy as jnp
    import hf_models
    from pallasite.model import load_hf
    from pallasite.model.quant_int import PackedInt
    tok = tok_fixtures.byte_level(400)
    hf_models.build("llama", config=dict(vocab_size=tok.get_vocab_size())).save_pretrained(
        tmp_path / "fp")
    tok_fixtures.save(tok, tmp_path / "fp")
    built, seen = [], []
    layer, inputs = q.quantized_layer, q.layer_inputs
    monkeypatch.setattr(q, "quantized_layer", lambda *a: built.append(layer(*a)) or built[-1])
    monkeypatch.setattr(q, "layer_inputs", lambda c, lp, x, pos: seen.append(x) or inputs(
        c, lp, x, pos))
    for sequential in (True, False):
        run(tmp_path / "fp", tmp_path / f"s{sequential}", "awq", sequential=sequential)
    assert len(built) == 2 and len(seen) == 4
    assert not np.allclose(seen[1], seen[3], rtol=1e-3, atol=1e-3)  # layer 1: quantized input
    np.testing.assert_array_equal(seen[0], seen[2])
    _, qp = load_hf(tmp_path / "sTrue", dtype=jnp.float32)
    got, want = jax.tree.leaves_with_path(built[0]), jax.tree.leaves_with_path(
        qp["layers_0"], is_leaf=lambda a: isinstance(a, PackedInt))
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, a), (_, b) in zip(got, want):
        b = b.dequantize() if isinstance(b, PackedInt) else b
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=str(path))


def test_folder_reads_back(model_dir, tmp_path):
    out = tmp_path / "asym"
    run(model_dir, out, "rtn", symmetric=False)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    quant = int_formats.parse_quantization_config(cfg)
    from safetensors.numpy import load_file
    tensors = load_file(out / "model.safetensors")
    lin = int_formats.read_linear(quant, tensors.__getitem__, tensors.__contains__,
                                  "model.layers.0.mlp.down_proj", (96, 64))
    assert lin.zero is not None and lin.group_size == 32
    assert "lm_head.weight" in tensors and "model.layers.1.mlp.down_proj.weight" not in tensors
    # the library's own decompression gives the same weight
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    p = "model.layers.0.mlp.down_proj."
    codes = unpack_from_int32(torch.from_numpy(tensors[p + "weight_packed"]), 4,
                              torch.Size([64, 96])).numpy().astype(np.float32)
    zp = unpack_from_int32(torch.from_numpy(tensors[p + "weight_zero_point"]), 4,
                           torch.Size([64, 3]), packed_dim=0).numpy()
    rows = np.arange(96) // 32
    w = (codes - zp[:, rows]) * tensors[p + "weight_scale"][:, rows]
    np.testing.assert_allclose(lin.dequantize(), w.T, rtol=1e-6, atol=1e-7)


def test_smoothquant_w8a8_beats_no_smoothing_and_serves(model_dir, tmp_path, monkeypatch):
    import jax.numpy as jnp
    from compressed_tensors.quantization import QuantizationConfig
    from pallasite.model import forward_logits, load_hf
    kw = dict(bits=8, group_size=-1, samples=4, seq_len=64, progress=False)
    smooth = q.quantize(model_dir, tmp_path / "sq", method="smoothquant", **kw)
    with monkeypatch.context() as m:  # the same W8A8 with every factor 1: no smoothing
        m.setattr(q, "smooth_scales", lambda *a: {})
        plain = q.quantize(model_dir, tmp_path / "plain", method="smoothquant", **kw)
    err = lambda r: np.mean([x["rel_err"] for x in r["linears"]])
    assert err(smooth) < 0.8 * err(plain), (err(smooth), err(plain))
    cfg = json.loads((tmp_path / "sq" / "config.json").read_text())["quantization_config"]
    group = QuantizationConfig.model_validate(cfg).config_groups["group_0"]
    assert cfg["format"] == "int-quantized" and group.input_activations.dynamic
    config, qp = load_hf(tmp_path / "sq", dtype=jnp.float32)
    w = qp["layers_0"]["mlp"]["w_down"]
    assert w.scheme == "int8" and w.q.dtype == jnp.int8
    _, fp = load_hf(model_dir, dtype=jnp.float32)
    ids = np.arange(1, 33)[None]
    got, want = forward_logits(qp, config, ids), forward_logits(fp, config, ids)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05
    with pytest.raises(ValueError, match="smoothquant is 8-bit"):
        q.quantize(model_dir, tmp_path / "x", method="smoothquant", bits=4, group_size=32)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_experts_quantize_beat_rtn_and_load(tmp_path, family):
    """MoE checkpoints: every expert is quantized (GPTQ on the rows routed to it, AWQ with one
    scale for all experts' gate/up and one per expert's down), AWQ and GPTQ beat RTN on the
    experts, the router stays float (and in `ignore`), and the folder loads as packed experts
    whose logits stay near the float model's."""
    import jax.numpy as jnp
    import hf_models
    from pallasite.model import forward_logits, load_hf
    from pallasite.model.quant_int import PackedInt
    tok = tok_fixtures.byte_level(400)
    sizes = dict(moe_intermediate_size=64) if family == "qwen3_moe" else {}  # groups of 32
    model = hf_models.build(family, config=dict(vocab_size=tok.get_vocab_size(), **sizes))
    with torch.no_grad():  # outlier input channels of the experts, for AWQ to find
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight[:3] *= 8
    fp = tmp_path / "fp"
    model.save_pretrained(fp)
    tok_fixtures.save(tok, fp)
    err = {}
    for m in ("rtn", "awq", "gptq"):
        lin = run(fp, tmp_path / m, m)["linears"]
        err[m] = np.mean([r["rel_err"] for r in lin if ".experts." in r["linear"]])
    assert err["awq"] < 0.95 * err["rtn"] and err["gptq"] < 0.9 * err["rtn"], err
    cfg = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert len(cfg["ignore"]) == 2 and cfg["ignore"][1].endswith(r"gate$")
    _, fw = load_hf(fp, dtype=jnp.float32)
    config, qp = load_hf(tmp_path / "rtn", dtype=jnp.float32)
    for name in ("w_gate", "w_up", "w_down"):  # written and read back as packed experts
        w, want = qp["layers_1"]["moe"][name], np.asarray(fw["layers_1"]["moe"][name])
        assert isinstance(w, PackedInt) and w.lead == 1
        assert np.linalg.norm(w.dequantize() - want) / np.linalg.norm(want) < 0.15
    np.testing.assert_array_equal(qp["layers_1"]["moe"]["router"], fw["layers_1"]["moe"]["router"])
    # At 8 bits the logits show the folds are right: AWQ's scale on the norm reaches the
    # router too (without it the error is ten times RTN's), each expert's down scale lands
    # in its own up.
    ids = np.arange(1, 33)[None]
    want = forward_logits(fw, config, ids)
    logits_err = {}
    for m in ("rtn", "awq", "gptq"):
        q.quantize(fp, tmp_path / f"{m}8", method=m, bits=8, group_size=32, samples=4,
                   seq_len=64, progress=False)
        got = forward_logits(load_hf(tmp_path / f"{m}8", dtype=jnp.float32)[1], config, ids)
        logits_err[m] = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert logits_err["rtn"] < 0.1 and max(logits_err.values()) < 1.5 * logits_err["rtn"], \
        logits_err
    with pytest.raises(ValueError, match="W8A8 mixture-of-experts"):
        q.quantize(fp, tmp_path / "x", method="smoothquant", bits=8, group_size=-1)


def test_moe_families_without_plain_experts_are_refused(tmp_path):
    import hf_models
    hf_models.save("gpt_oss", tmp_path / "oss")
    with pytest.raises(ValueError, match=r"mixture-of-experts models \(gpt_oss\) are not "
                                         r"supported \(weight-only: mixtral, qwen3_moe\)"):
        q.quantize(tmp_path / "oss", tmp_path / "out", method="rtn", progress=False)
