"""Greedy pass@1 on held-out prompts with a sampler engine and the reward service."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_async.sampler import Engine, Request, SamplerConfig, SamplerLoop


def eval_sampler_config(cfg: SamplerConfig, data: int, max_slots: int = 64) -> SamplerConfig:
    """The greedy eval engine's settings: the sampler's, greedy, with at most `max_slots` slots (a multiple
    of the sampler mesh's data axis `data`), each as long as the sampler's."""
    slots = data * max(1, min(cfg.num_slots, max_slots) // data)
    return dataclasses.replace(
        cfg, temperature=0.0, top_k=0, top_p=1.0, num_slots=slots, token_budget=slots * cfg.slot_len
    )


def evaluate_accuracy(
    engine: Engine, rewards, tokenizer, prompts, sampler_params, version: int | None = None
) -> float:
    """The fraction of `prompts` whose greedy completion gets reward >= 1.

    Args:
      engine: a greedy engine (temperature 0) on the sampler mesh.
      rewards: the RewardService (grades in its worker processes).
      tokenizer: decodes completions.
      prompts: jaxrl_async.data.Prompt records.
      sampler_params: weights in the sampler layout, or None to decode with the engine's current weights
        (an eval engine built with `weights_from` the sampler's engine shares those).
      version: their policy version (with sampler_params).
    """
    if sampler_params is not None:
        engine.update_params(sampler_params, version)
    loop = SamplerLoop(engine)
    it = iter(prompts)

    def admit():
        p = next(it, None)
        return (
            None
            if p is None
            else Request(uid=p.uid, prompt_tokens=tuple(int(t) for t in p.tokens), metadata=p)
        )

    completions = loop.run(admit)
    items = [(c.metadata.text, tokenizer.decode(c.tokens), dict(c.metadata.metadata)) for c in completions]
    scores = rewards.grade_batch(items)
    return float(np.mean([r >= 1.0 for r in scores])) if scores else 0.0
