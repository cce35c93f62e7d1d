"""Greedy pass@1 on held-out prompts with a sampler engine and the reward service."""

from __future__ import annotations

import numpy as np

from jaxrl_async.sampler import Engine, Request, SamplerLoop


def evaluate_accuracy(engine: Engine, rewards, tokenizer, prompts, sampler_params, version: int) -> float:
    """The fraction of `prompts` whose greedy completion gets reward >= 1.

    Args:
      engine: a greedy engine (temperature 0) on the sampler mesh.
      rewards: the RewardService (grades in its worker processes).
      tokenizer: decodes completions.
      prompts: jaxrl_async.data.Prompt records.
      sampler_params: weights in the sampler layout.
      version: their policy version.
    """
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
