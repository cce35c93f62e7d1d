"""Supervised warm start (SFT on reference completions) so RL on a synthetic task has signal, cached on disk.

RL from a random policy gets almost no reward on multi-digit arithmetic; a short supervised phase brings the
policy to a modest accuracy (stopped at `target_accuracy`, so RL still has most of the way to go).

An example is a (prompt, completion) pair, or a whole multi-turn episode (prompt, completion, model mask):
the completion holds the model's turns and the environment's observations in order, and the mask says
which tokens are the model's. Only those are trained: an observation (a tool's result) is context, never
a target, so a warm start on tool episodes teaches when and how to call and what to do with the answer,
not the answers themselves (configs/calc_tool.py).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_async.model import ModelConfig, forward, load_hf, save_hf, token_logprobs

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start settings.

    Attributes:
      enabled: run the warm start (else RL starts from the initial weights).
      max_steps: upper bound on optimizer steps.
      batch: sequences per step.
      seq_len: padded sequence length (prompt + reference completion + eos must fit).
      lr: AdamW learning rate.
      target_accuracy: stop once held-out greedy accuracy reaches this.
      eval_every: steps between accuracy checks.
      cache_dir: where finished warm starts are kept, keyed by a hash of everything that affects them.
    """

    enabled: bool = True
    max_steps: int = 400
    batch: int = 128
    seq_len: int = 16
    lr: float = 1e-3
    target_accuracy: float = 0.3
    eval_every: int = 20
    cache_dir: str = "~/.cache/jaxrl_async/warmstart"

    def __post_init__(self):
        for name in ("max_steps", "batch", "seq_len", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"WarmStartConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.lr < 1:
            raise ValueError(f"WarmStartConfig.lr must be in (0, 1), got {self.lr}")
        if not 0 < self.target_accuracy <= 1:
            raise ValueError(f"WarmStartConfig.target_accuracy must be in (0, 1], got {self.target_accuracy}")


def cache_key(*parts) -> str:
    """A stable hash of the JSON form of `parts` (configs as dicts)."""
    blob = json.dumps(
        [dataclasses.asdict(p) if dataclasses.is_dataclass(p) else p for p in parts],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def episode_example(
    encode: Callable[[str], list[int]],
    eos_id: int,
    prompt_ids: Sequence[int],
    segments: Sequence[tuple[str, bool]],
) -> tuple[list[int], list[int], list[bool]]:
    """A multi-turn warm-start example from (text, is_model_turn) segments in episode order: (prompt ids,
    completion ids, model mask). Each model turn ends with `eos_id`, the stop token that ends a turn in
    the sampler (an episode's context holds it before the next observation); observations are encoded as
    they are and masked."""
    completion: list[int] = []
    model: list[bool] = []
    for text, is_model in segments:
        ids = list(encode(text)) + ([eos_id] if is_model else [])
        completion += ids
        model += [bool(is_model)] * len(ids)
    return list(prompt_ids), completion, model


def make_sft_batch(examples: Sequence[tuple], seq_len: int, pad_id: int = 0):
    """Packs examples into [B, seq_len] inputs, targets and a loss mask.

    An example is (prompt, completion) (every completion token is trained) or (prompt, completion,
    model_mask) with one bool per completion token (only the True ones are trained: a multi-turn episode's
    observations are False). Prompt tokens are never trained."""
    b = len(examples)
    inputs = np.full((b, seq_len), pad_id, np.int32)
    targets = np.full((b, seq_len), pad_id, np.int32)
    mask = np.zeros((b, seq_len), np.float32)
    for i, example in enumerate(examples):
        prompt, completion = list(example[0]), list(example[1])
        trained = [True] * len(completion) if len(example) == 2 else [bool(m) for m in example[2]]
        if len(trained) != len(completion):
            raise ValueError(
                f"warm start: a model mask of {len(trained)} for a completion of {len(completion)} tokens"
            )
        seq = prompt + completion
        if len(seq) > seq_len + 1:
            raise ValueError(f"warm start: sequence of {len(seq)} tokens exceeds seq_len={seq_len} + 1")
        inputs[i, : len(seq) - 1] = seq[:-1]
        targets[i, : len(seq) - 1] = seq[1:]
        # Position j predicts seq[j + 1]: the completion's k-th token is the target at len(prompt) - 1 + k.
        start = len(prompt) - 1
        mask[i, start : start + len(completion)] = np.asarray(trained, np.float32)
    return inputs, targets, mask


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))
def _sft_step(model_cfg: ModelConfig, tx, params, opt_state, inputs_BxT, targets_BxT, mask_BxT):
    positions = jnp.broadcast_to(jnp.arange(inputs_BxT.shape[1]), inputs_BxT.shape)

    def loss_fn(p):
        logits = forward(model_cfg, p, inputs_BxT, positions)
        logp, _ = token_logprobs(logits, targets_BxT)
        return -(logp * mask_BxT).sum() / jnp.maximum(mask_BxT.sum(), 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def warm_start(
    model_cfg: ModelConfig,
    params: dict,
    examples: Iterator[tuple[Sequence[int], Sequence[int]]],
    evaluate: Callable[[dict], float],
    cfg: WarmStartConfig,
    key: str,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict, dict]:
    """Trains `params` on reference completions until `evaluate(params)` >= target, or loads the cache.

    Args:
      model_cfg, params: the model (params may be sharded; the step keeps their shardings).
      examples: endless (prompt tokens, completion tokens incl. eos) pairs, or (prompt, completion,
        model mask) episodes (`make_sft_batch`, `episode_example`).
      evaluate: held-out accuracy of a parameter tree.
      cfg: warm start settings.
      key: cache key (see `cache_key`) naming everything the result depends on.
      progress: called with (step, max_steps).

    Returns:
      (params, info) with info = {"cached", "steps", "accuracy", "seconds"}.
    """
    path = os.path.join(os.path.expanduser(cfg.cache_dir), key)
    shardings = jax.tree.map(lambda x: x.sharding, params)
    info_path = os.path.join(path, "warm_start.json")
    if os.path.exists(os.path.join(path, "config.json")):
        _, cached = load_hf(path, dtype=model_cfg.dtype, param_dtype=model_cfg.param_dtype)
        cached = jax.device_put(cached, shardings)
        if os.path.exists(info_path):  # measured when the cache was written: no engine needed now
            with open(info_path) as f:
                acc = float(json.load(f)["accuracy"])
        else:
            acc = evaluate(cached)
        log.info("warm start: loaded %s (held-out accuracy %.3f)", path, acc)
        return cached, {"cached": True, "steps": 0, "accuracy": acc, "seconds": 0.0}
    t0 = time.time()
    tx = optax.adamw(cfg.lr, weight_decay=0.0)
    opt_state = tx.init(params)
    acc, step = evaluate(params), 0
    while acc < cfg.target_accuracy and step < cfg.max_steps:
        pairs = [next(examples) for _ in range(cfg.batch)]
        inputs, targets, mask = make_sft_batch(pairs, cfg.seq_len)
        params, opt_state, loss = _sft_step(model_cfg, tx, params, opt_state, inputs, targets, mask)
        step += 1
        if progress:
            progress(step, cfg.max_steps)
        if step % cfg.eval_every == 0:
            acc = evaluate(params)
            log.info("warm start step %d: loss %.4f held-out accuracy %.3f", step, float(loss), acc)
    save_hf(model_cfg, params, path)
    with open(info_path, "w") as f:
        json.dump({"accuracy": acc, "steps": step}, f)
    return params, {"cached": False, "steps": step, "accuracy": acc, "seconds": time.time() - t0}
