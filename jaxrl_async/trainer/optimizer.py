"""AdamW with linear warmup + cosine decay and global-norm clipping."""

from __future__ import annotations

import jax
import optax

from jaxrl_async.trainer.config import TrainConfig

_NO_DECAY = ("norm", "bias")


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """0 -> lr over warmup_steps, then cosine to lr * end_lr_ratio at total_steps (train steps)."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if cfg.warmup_steps else cfg.lr,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps,
        end_value=cfg.lr * cfg.end_lr_ratio,
    )


def update_schedule(cfg: TrainConfig) -> optax.Schedule:
    """The rate of the n-th optimizer update: a train step makes cfg.minibatches updates, and the schedule
    is in train steps, so that warmup_steps and total_steps mean steps whatever the minibatch count."""
    per_step = learning_rate_schedule(cfg)
    return lambda count: per_step(count // cfg.minibatches)


def decay_mask(params) -> dict:
    """True for weight matrices; False for norms, biases and anything named like them."""

    def keep(path, leaf) -> bool:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return not any(tag in name for tag in _NO_DECAY)

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """The trainer's optimizer: [clip by global norm] -> AdamW(schedule)."""
    adamw = optax.adamw(
        update_schedule(cfg),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        mask=decay_mask,
    )
    if cfg.clip_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
