"""What the plan explorer predicts for one point that `validate` measured: its step time and
bound, and its per-device memory (weights, the KV pool the run allocated, activations)."""

from __future__ import annotations

PAGE = 16
GB = 1e9

TINY_MODELS = {
    "tiny-dense": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512),
    "tiny-moe": dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128,
                     moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=512),
}


def load(name: str, layers):
    from pallasite.model import config_from_dict
    from pallasite.tools.plan.inputs import load_model
    if name in TINY_MODELS:
        return config_from_dict(TINY_MODELS[name], name=name)
    return load_model(name, layers)


def config_of(model: str):
    """The config of a record's model: "<preset>-<N>L" names a preset cut to N layers."""
    name, _, layers = model.rpartition("-")
    if layers.endswith("L") and layers[:-1].isdigit():
        return load(name, int(layers[:-1]))
    return load(model, None)


def context_of(rec: dict) -> int:
    """Tokens in each sequence's cache after the step."""
    return rec["length"] + (rec["phase"] == "decode")


def predict(rec: dict, gpu: str):
    """The explorer's step time (ms) and bound for one measured point, with today's model."""
    from pallasite.sharding import MeshPlan
    from pallasite.tools.plan import inputs as pi, model as pm
    config, plan = config_of(rec["model"]), MeshPlan.parse(rec["plan"])
    cluster = pi.Cluster(pi.GPUS[gpu], gpus_per_host=max(8, plan.size))
    step = (pm.prefill_step if rec["phase"] == "prefill" else pm.decode_step)(
        config, pm.shapes_of(config, plan), plan, cluster, pi.Workload(page_size=PAGE),
        rec["batch"], rec["length"])
    return step.time * 1e3, step.bound


def predict_peak(rec: dict) -> dict:
    """The explorer's per-device memory of one point: the weights, the KV pool the run
    allocated (`num_pages`) and the step's activations (`model.activation_bytes`)."""
    from pallasite.sharding import MeshPlan
    from pallasite.tools.plan import model as pm
    config, plan = config_of(rec["model"]), MeshPlan.parse(rec["plan"])
    weights = pm.shapes_of(config, plan).device_total * 2
    kv = rec["num_pages"] * PAGE * pm.kv_bytes_per_token(config, plan, 2)
    act = pm.activation_bytes(config, plan, rec["tokens"], rec["batch"], context_of(rec), 2, PAGE)
    return dict(predicted_peak_gb=(weights + kv + act) / GB, predicted_act_gb=act / GB,
                predicted_weights_gb=weights / GB, predicted_kv_gb=kv / GB)


def gpu_key(kind: str) -> str:
    return "h200" if "H200" in kind else "h100"
