"""The held-out expected reward: the exact probability that the policy, sampling as the run samples,
writes a prompt's accepted completion, weighted as held-out accuracy is.

Why beside greedy accuracy: one greedy pass scores each prompt 0 or 1, so a held-out set of a few hundred
prompts has an item standard error of about 4 points near 0.45 and the figure jumps by whole prompts
between evaluations. The expected reward is a probability per prompt, computed exactly in one
teacher-forced forward pass over prompt + accepted completion (+ a stop token): no sampling noise at all,
and a standard error (over the held-out items) several times smaller, so a few evaluations resolve
differences of a point or two.

What "accepted" means: the reference completion `Prompt.answer`, token for token, then one of the
sampler's stop tokens (or nothing when the answer fills `max_new_tokens` exactly, where the sampler stops
on the limit). That is the whole set the reward accepts for the exact-match tasks listed in
`EXACT_MATCH_REWARDS`; their rewards strip whitespace, so completions padded with spaces are accepted too
and the figure is a lower bound by their (tiny) probability. A task whose reward accepts many completions
(countdown, math, code) has no such pass: `expected_reward` refuses it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_async.model import ModelConfig
from jaxrl_async.model.transformer import forward_logits, token_logprobs

log = logging.getLogger(__name__)

# Rewards that give 1 exactly when the stripped completion equals the reference answer.
EXACT_MATCH_REWARDS = ("arithmetic", "letter_range")
_BUCKET = 32  # rows are padded to a multiple of this many positions (few shapes, few compiles)


@dataclasses.dataclass(frozen=True)
class ExpectedReward:
    """The weighted mean over prompts of P(accepted completion), and its standard error over the items."""

    mean: float
    stderr: float
    prompts: int


def check_applicable(reward: str, temperature: float, top_k: int, top_p: float) -> None:
    """Raises ValueError naming the field when the expected reward cannot be computed exactly."""
    if reward not in EXACT_MATCH_REWARDS:
        raise ValueError(f"config.reward.reward={reward!r}: the expected reward needs an exact-match reward "
                         f"({', '.join(EXACT_MATCH_REWARDS)})")  # fmt: skip
    if temperature <= 0:
        raise ValueError("config.sampler.temperature=0: a greedy policy's expected reward is its accuracy")
    if top_k or top_p < 1.0:
        raise ValueError(f"config.sampler.top_k={top_k}, top_p={top_p}: the expected reward is exact only "
                         "for untruncated sampling (top_k=0, top_p=1)")  # fmt: skip


def completion_logprobs(model_cfg: ModelConfig, params, prompt_tokens, completions, temperature: float):
    """log P(completion | prompt) at `temperature` for each (prompt, [token ids]) pair: one forward pass
    per batch of rows, the sum of the completion tokens' logprobs. Returns float64 [N]."""
    rows = [list(map(int, p)) + list(map(int, c)) for p, c in zip(prompt_tokens, completions, strict=True)]
    width = _BUCKET * math.ceil(max(len(r) for r in rows) / _BUCKET)
    tokens_NxT = np.zeros((len(rows), width), np.int32)  # right padding: causal, so it changes nothing
    mask_NxT = np.zeros((len(rows), width), np.float32)  # 1 where the target is a completion token
    for i, (p, r) in enumerate(zip(prompt_tokens, rows, strict=True)):
        tokens_NxT[i, : len(r)] = r
        mask_NxT[i, len(p) - 1 : len(r) - 1] = 1.0  # position t predicts token t + 1
    logits_NxTxV = forward_logits(model_cfg, params, jnp.asarray(tokens_NxT))
    targets_NxT = jnp.roll(jnp.asarray(tokens_NxT), -1, axis=1)
    logp_NxT, _ = token_logprobs(logits_NxTxV, targets_NxT, temperature)
    return np.asarray(jax.device_get(jnp.sum(logp_NxT * mask_NxT, axis=1)), np.float64)


def expected_reward(model_cfg: ModelConfig, params, *, prompts, tokenizer, stop_tokens, max_new_tokens: int,
                    temperature: float, batch: int = 64) -> ExpectedReward:  # fmt: skip
    """The held-out expected reward of `params` on `prompts` (jaxrl_async.data.Prompt records, weighted by
    `Prompt.weight`), sampling at `temperature` with `stop_tokens` and `max_new_tokens` as the sampler
    does. See the module docstring for what is accepted."""
    if not stop_tokens:
        raise ValueError("config.sampler.stop_tokens: empty; the expected reward needs the stop tokens")
    pairs, owner = [], []  # one row per (prompt, accepted completion)
    for i, p in enumerate(prompts):
        answer = tokenizer.encode(p.answer)
        if len(answer) == max_new_tokens:  # the limit stops it: no stop token needed
            pairs.append((p.tokens, answer))
            owner.append(i)
        elif len(answer) < max_new_tokens:
            for s in stop_tokens:
                pairs.append((p.tokens, [*answer, s]))
                owner.append(i)
    prob = np.zeros(len(prompts))
    for start in range(0, len(pairs), batch):
        chunk = pairs[start : start + batch]
        logp = completion_logprobs(model_cfg, params, [c[0] for c in chunk], [c[1] for c in chunk],
                                   temperature)  # fmt: skip
        np.add.at(prob, owner[start : start + batch], np.exp(logp))
    weights = np.array([float(p.weight) for p in prompts])
    mean = float(np.average(prob, weights=weights)) if len(prompts) else 0.0
    # The weighted mean's standard error over the held-out items (weights normalised to sum to 1).
    w = weights / weights.sum() if len(prompts) else weights
    n_eff = 1.0 / float(np.sum(w**2)) if len(prompts) else 0.0
    var = float(np.sum(w * (prob - mean) ** 2)) if len(prompts) else 0.0
    stderr = math.sqrt(var / max(n_eff - 1.0, 1.0)) if len(prompts) > 1 else 0.0
    return ExpectedReward(mean, stderr, len(prompts))


def scorer(reward: str, sampler_cfg, model_cfg: ModelConfig, prompts, tokenizer) -> Callable | None:
    """`params -> ExpectedReward` on `prompts` as the run samples (`sampler_cfg`: its temperature, stop
    tokens and generation limit), or None, saying why once, where the figure cannot be exact or there is
    nothing to score."""
    try:
        check_applicable(reward, sampler_cfg.temperature, sampler_cfg.top_k, sampler_cfg.top_p)
    except ValueError as e:
        log.info("eval/expected_reward is not computed: %s", e)
        return None
    if not prompts:
        return None
    return functools.partial(expected_reward, model_cfg, prompts=prompts, tokenizer=tokenizer,
                             stop_tokens=sampler_cfg.stop_tokens, max_new_tokens=sampler_cfg.max_new_tokens,
                             temperature=sampler_cfg.temperature)  # fmt: skip
