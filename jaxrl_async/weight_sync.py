"""Trainer -> sampler weight sync: reshard the trainer's parameters into the sampler layout, versioned."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxrl_async.model import ModelConfig, param_shardings
from jaxrl_async.model.config import DTYPES
from jaxrl_async.sharding import SAMPLER_RULES, Rules


class WeightSync:
    """Moves parameters onto the sampler mesh with `jax.device_put` into the sampler's layout.

    The target shardings derive from the same parameter declaration as the trainer's, so the two layouts
    always describe one tree. With `dtype` (e.g. "bfloat16" from float32 master weights) the cast runs
    on the trainer's devices before the transfer, so half the bytes move; `sampler_cfg` is then the
    model config whose parameter layout the copy has (give it to the sampler's Engine).
    The copy never shares a buffer with the trainer's parameters (the train step donates those), also
    when both roles sit on the same devices.
    """

    def __init__(
        self, cfg: ModelConfig, sampler_mesh, rules: Rules = SAMPLER_RULES, dtype: str | None = None
    ):
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"WeightSync: dtype={dtype!r} not in {DTYPES} (or None: keep the trainer's)")
        self.shardings = param_shardings(cfg, sampler_mesh, rules)
        self.dtype = dtype  # e.g. "bfloat16" to sample in bf16 from fp32 master weights
        self.sampler_cfg = cfg if dtype is None else cfg.replace(param_dtype=dtype)
        # A leaf already in `dtype` is copied: returning it as is would hand back the trainer's buffer.
        cast = lambda x: jnp.copy(x) if x.dtype == jnp.dtype(dtype) else x.astype(dtype)
        self._cast = jax.jit(lambda tree: jax.tree.map(cast, tree))
        self.last_seconds = 0.0
        self.total_seconds = 0.0
        self.count = 0

    def __call__(self, trainer_params: dict) -> dict:
        """Returns the sampler's copy; blocks until it has arrived so the timing is the transfer's."""
        t0 = time.perf_counter()
        if self.dtype is not None:
            # New buffers on the trainer's devices; where a target layout equals them they are reused.
            out = jax.device_put(self._cast(trainer_params), self.shardings)
        else:
            out = jax.device_put(trainer_params, self.shardings, may_alias=False)
        jax.block_until_ready(out)
        self.last_seconds = time.perf_counter() - t0
        self.total_seconds += self.last_seconds
        self.count += 1
        return out
