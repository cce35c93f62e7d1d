"""The trainer: advantages, policy losses, sequence packing, optimizer and the sharded train step."""

from jaxrl_async.trainer.advantages import ADVANTAGES, compute_advantages, kl_estimate, register_advantage
from jaxrl_async.trainer.config import TrainConfig
from jaxrl_async.trainer.losses import LOSSES, finalize_metrics, policy_loss, register_loss
from jaxrl_async.trainer.optimizer import learning_rate_schedule, make_optimizer
from jaxrl_async.trainer.packing import PackedBatch, TrainSample, ffd_bins, pack_rollouts, pad_rollouts
from jaxrl_async.trainer.train_step import (
    TrainState,
    compute_logprobs,
    create_train_state,
    loglinear_prox_logp,
    loss_and_grads,
    prepare_batch,
    train_step,
)

__all__ = [
    "ADVANTAGES",
    "LOSSES",
    "PackedBatch",
    "TrainSample",
    "TrainConfig",
    "TrainState",
    "compute_advantages",
    "compute_logprobs",
    "create_train_state",
    "ffd_bins",
    "finalize_metrics",
    "kl_estimate",
    "learning_rate_schedule",
    "loglinear_prox_logp",
    "loss_and_grads",
    "make_optimizer",
    "pack_rollouts",
    "pad_rollouts",
    "policy_loss",
    "prepare_batch",
    "register_advantage",
    "register_loss",
    "train_step",
]
