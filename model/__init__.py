"""The graph layer: model config, pure-functional Flax decoder, checkpoint loading."""

from .attention import Batch
from .default import default_model_path
from .config import ConfigError, ModelConfig, config_from_dict, load_config, to_hf_dict
from . import quant
from .loader import CheckpointError, hf_sources, load_hf
from .transformer import (forward, forward_logits, init_kv_cache, init_params, kv_cache_shape,
                          param_logical_axes, param_shapes)
