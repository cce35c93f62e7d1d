"""The decoder-only transformer (Llama 3.x, Qwen2/2.5, Qwen3) and its Hugging Face checkpoints."""

from jaxrl_async.model import presets
from jaxrl_async.model.config import ModelConfig, RopeScaling, from_hf_config, to_hf_config
from jaxrl_async.model.hf import load_hf, save_hf
from jaxrl_async.model.params import (
    ParamSpec,
    abstract_params,
    init_params,
    param_shardings,
    param_specs,
)
from jaxrl_async.model.transformer import (
    chunked_token_logprobs,
    forward,
    forward_logits,
    token_logprobs,
    unembed,
)

__all__ = [
    "ModelConfig",
    "ParamSpec",
    "RopeScaling",
    "abstract_params",
    "chunked_token_logprobs",
    "forward",
    "forward_logits",
    "from_hf_config",
    "init_params",
    "load_hf",
    "param_shardings",
    "param_specs",
    "presets",
    "save_hf",
    "to_hf_config",
    "token_logprobs",
    "unembed",
]
