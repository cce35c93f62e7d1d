"""Trainer -> sampler weight sync: reshard the trainer's parameters into the sampler layout, versioned."""

from __future__ import annotations

import time

import jax

from jaxrl_async.model import ModelConfig, param_shardings
from jaxrl_async.sharding import SAMPLER_RULES, Rules


class WeightSync:
    """Moves parameters onto the sampler mesh with `jax.device_put` into the sampler's layout.

    The target shardings derive from the same parameter declaration as the trainer's, so the two layouts
    always describe one tree.
    """

    def __init__(
        self, cfg: ModelConfig, sampler_mesh, rules: Rules = SAMPLER_RULES, dtype: str | None = None
    ):
        self.shardings = param_shardings(cfg, sampler_mesh, rules)
        self.dtype = dtype  # e.g. "bfloat16" to sample in bf16 from fp32 master weights
        self.last_seconds = 0.0
        self.total_seconds = 0.0
        self.count = 0

    def __call__(self, trainer_params: dict) -> dict:
        """Returns the sampler's copy; blocks until it has arrived so the timing is the transfer's."""
        t0 = time.perf_counter()
        params = trainer_params
        if self.dtype is not None:
            params = jax.tree.map(lambda x: x.astype(self.dtype), params)
        out = jax.device_put(params, self.shardings)
        jax.block_until_ready(out)
        self.last_seconds = time.perf_counter() - t0
        self.total_seconds += self.last_seconds
        self.count += 1
        return out
