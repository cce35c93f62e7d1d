"""Parameters declared once, abstract-first: shape, dtype, logical axes and initializer per leaf.

Init, shardings, checkpoint restore targets and weight-sync layouts all derive from `param_specs`.
Layer weights are stacked with a leading [L] axis so the forward scans over layers (one compiled layer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl_async.model.config import ModelConfig
from jaxrl_async.sharding import Rules, tree_shardings


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter leaf: its shape, dtype, logical axis names and initializer."""

    shape: tuple[int, ...]
    dtype: str
    logical_axes: tuple[str | None, ...]
    init: str = "normal"  # "normal" (scaled by fan-in), "ones", "zeros"
    fan_in: int = 1

    def __post_init__(self):
        if len(self.shape) != len(self.logical_axes):
            raise ValueError(f"ParamSpec: shape {self.shape} vs logical axes {self.logical_axes}")

    def abstract(self, sharding=None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, jnp.dtype(self.dtype), sharding=sharding)

    def initialize(self, key) -> jax.Array:
        dtype = jnp.dtype(self.dtype)
        if self.init == "ones":
            return jnp.ones(self.shape, dtype)
        if self.init == "zeros":
            return jnp.zeros(self.shape, dtype)
        std = self.fan_in**-0.5
        return (std * jax.random.truncated_normal(key, -2.0, 2.0, self.shape, jnp.float32)).astype(dtype)


def param_specs(cfg: ModelConfig) -> dict:
    """The parameter tree of `cfg` as ParamSpecs (nested dicts; layer leaves lead with [L])."""
    L, D, H, G, K, F, V = (
        cfg.n_layers,
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.ffw_size,
        cfg.vocab_size,
    )
    p = lambda shape, axes, init="normal", fan_in=1: ParamSpec(
        tuple(shape), cfg.param_dtype, tuple(axes), init, fan_in
    )
    layer = {
        "attn_norm": p((L, D), ("layers", None), "ones"),
        "q": p((L, D, H, K), ("layers", "embed", "q_heads", "head_dim"), fan_in=D),
        "k": p((L, D, G, K), ("layers", "embed", "kv_heads", "head_dim"), fan_in=D),
        "v": p((L, D, G, K), ("layers", "embed", "kv_heads", "head_dim"), fan_in=D),
        "o": p((L, H, K, D), ("layers", "q_heads", "head_dim", "embed"), fan_in=H * K),
        "mlp_norm": p((L, D), ("layers", None), "ones"),
        "gate": p((L, D, F), ("layers", "embed", "mlp"), fan_in=D),
        "up": p((L, D, F), ("layers", "embed", "mlp"), fan_in=D),
        "down": p((L, F, D), ("layers", "mlp", "embed"), fan_in=F),
    }
    if cfg.qkv_bias:
        layer["q_bias"] = p((L, H, K), ("layers", "q_heads", "head_dim"), "zeros")
        layer["k_bias"] = p((L, G, K), ("layers", "kv_heads", "head_dim"), "zeros")
        layer["v_bias"] = p((L, G, K), ("layers", "kv_heads", "head_dim"), "zeros")
    if cfg.o_bias:
        layer["o_bias"] = p((L, D), ("layers", None), "zeros")
    if cfg.qk_norm and cfg.qk_norm_all_heads:
        layer["q_norm"] = p((L, H, K), ("layers", "q_heads", "head_dim"), "ones")
        layer["k_norm"] = p((L, G, K), ("layers", "kv_heads", "head_dim"), "ones")
    elif cfg.qk_norm:
        layer["q_norm"] = p((L, K), ("layers", None), "ones")
        layer["k_norm"] = p((L, K), ("layers", None), "ones")
    specs = {
        "embed": p((V, D), ("vocab", "embed"), fan_in=1),
        "layers": layer,
        "final_norm": p((D,), (None,), "ones"),
    }
    if not cfg.tie_embeddings:
        specs["lm_head"] = p((D, V), ("embed", "vocab"), fan_in=D)
    return specs


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def abstract_params(cfg: ModelConfig, mesh=None, rules: Rules | None = None) -> dict:
    """ShapeDtypeStructs (with shardings when a mesh is given): checkpoint restore / weight-sync targets."""
    specs = param_specs(cfg)
    if mesh is None:
        return jax.tree.map(lambda s: s.abstract(), specs, is_leaf=_is_spec)
    shardings = tree_shardings(specs, mesh, rules)
    return jax.tree.map(lambda s, sh: s.abstract(sh), specs, shardings, is_leaf=_is_spec)


def param_shardings(cfg: ModelConfig, mesh, rules: Rules) -> dict:
    """NamedShardings of the parameter tree for one role's mesh."""
    return tree_shardings(param_specs(cfg), mesh, rules)


def init_params(cfg: ModelConfig, key, mesh=None, rules: Rules | None = None) -> dict:
    """Random parameters, created directly in their target sharding when a mesh is given."""
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)

    def make(key) -> dict:
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(treedef, [s.initialize(keys[i]) for i, s in enumerate(leaves)])

    out_shardings = None if mesh is None else param_shardings(cfg, mesh, rules)
    return jax.jit(make, out_shardings=out_shardings)(key)


def map_specs(fn: Callable[[ParamSpec], object], cfg: ModelConfig) -> dict:
    """Applies `fn` to every ParamSpec of `cfg`'s tree."""
    return jax.tree.map(fn, param_specs(cfg), is_leaf=_is_spec)
