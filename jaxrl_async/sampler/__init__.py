"""The sampler: a decode engine over a slotted or paged KV cache, continuous batching and in-flight weight
updates."""

from jaxrl_async.sampler.config import UPDATE_MODES, SamplerConfig
from jaxrl_async.sampler.engine import Engine, Prefix, Round, check_params
from jaxrl_async.sampler.layout import DecodeState
from jaxrl_async.sampler.loop import Completion, Request, SamplerLoop, SamplerStats
from jaxrl_async.sampler.sampling import sample
from jaxrl_async.sampler.spec import EngineSpec, engine_spec

__all__ = [
    "UPDATE_MODES",
    "Completion",
    "DecodeState",
    "Engine",
    "EngineSpec",
    "Prefix",
    "Request",
    "Round",
    "SamplerConfig",
    "SamplerLoop",
    "SamplerStats",
    "check_params",
    "engine_spec",
    "sample",
]
