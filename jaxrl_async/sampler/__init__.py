"""The sampler: a slotted KV-cache decode engine, continuous batching and in-flight weight updates."""

from jaxrl_async.sampler.config import UPDATE_MODES, SamplerConfig
from jaxrl_async.sampler.engine import Engine, Prefix, Round, check_params
from jaxrl_async.sampler.loop import Completion, Request, SamplerLoop, SamplerStats
from jaxrl_async.sampler.sampling import sample

__all__ = [
    "UPDATE_MODES",
    "Completion",
    "Engine",
    "Prefix",
    "Request",
    "Round",
    "SamplerConfig",
    "SamplerLoop",
    "SamplerStats",
    "check_params",
    "sample",
]
