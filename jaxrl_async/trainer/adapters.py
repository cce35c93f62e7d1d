"""The trainer's side of LoRA (config.trainer.lora): which tree is trained, and where it lives.

With lora.enabled the train state's `params` are the adapters (float32 masters: the only leaves with
gradients and AdamW moments) and `frozen` is the base, held once in the compute dtype (the sampler's
dtype): it is an input of every program, never differentiated, never updated. Without it `params` is the
whole model and `frozen` is None, and nothing here changes what the step computes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_async.model import ModelConfig, abstract_params, param_shardings
from jaxrl_async.model import lora as lora_lib
from jaxrl_async.model.params import ParamSpec
from jaxrl_async.sharding import TRAINER_RULES, tree_shardings
from jaxrl_async.trainer.config import TrainConfig


def trainable_shardings(cfg: TrainConfig, model_cfg: ModelConfig, mesh) -> dict | None:
    """Shardings of the trained tree (and of its gradients and moments) on `mesh`; None without a mesh."""
    if mesh is None:
        return None
    if cfg.lora.enabled:
        return tree_shardings(lora_lib.adapter_specs(model_cfg, cfg.lora), mesh, TRAINER_RULES)
    return param_shardings(model_cfg, mesh, TRAINER_RULES)


def abstract_trainable(cfg: TrainConfig, model_cfg: ModelConfig, mesh) -> dict:
    """ShapeDtypeStructs of the trained tree on `mesh` (the adapters, or the whole model)."""
    if not cfg.lora.enabled:
        return abstract_params(model_cfg, mesh, TRAINER_RULES)
    specs = lora_lib.adapter_specs(model_cfg, cfg.lora)
    sh = tree_shardings(specs, mesh, TRAINER_RULES)
    return jax.tree.map(lambda s, x: s.abstract(x), specs, sh, is_leaf=lambda x: isinstance(x, ParamSpec))


def abstract_frozen(cfg: TrainConfig, model_cfg: ModelConfig, mesh) -> dict | None:
    """The frozen base as ShapeDtypeStructs in the compute dtype (None without LoRA)."""
    if not cfg.lora.enabled:
        return None
    as_compute = lambda x: jax.ShapeDtypeStruct(x.shape, model_cfg.dtype, sharding=x.sharding)
    return jax.tree.map(as_compute, abstract_params(model_cfg, mesh, TRAINER_RULES))


def split_initial(cfg: TrainConfig, model_cfg: ModelConfig, params, shardings, mesh, key=None):
    """(trained tree, frozen tree) from the starting parameters `params` placed by `shardings`.

    LoRA: fresh adapters (seeded by `key`, default key 0) and the base cast once to the compute dtype; a
    fresh copy either way, so the caller's arrays are neither donated nor held."""
    lora = cfg.lora
    cast = lambda x: x.astype(model_cfg.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    frozen = jax.jit(lambda t: jax.tree.map(cast, t), out_shardings=shardings)(params)
    key = jax.random.key(0) if key is None else key
    adapters = lora_lib.init_adapters(model_cfg, lora, key, trainable_shardings(cfg, model_cfg, mesh))
    return adapters, frozen


def model_params(cfg: TrainConfig, params, frozen):
    """The tree the model runs: `params` itself, or the base with the adapters beside it (unmerged)."""
    if frozen is None:
        return params
    return lora_lib.combine(frozen, params, cfg.lora)
