"""Greedy pass@1 on held-out prompts with a sampler engine and the reward service.

An evaluation runs on its own schedule beside sampling (`Evaluation`): the actor advances it by one
generate call of the greedy eval engine per round of its event loop, between the sampling engine's calls,
and grades its completions through the reward service without waiting. So in a one-process run the
trainer keeps stepping while an evaluation is in progress, and the sampler keeps producing rollouts.
Why its own schedule (and its own engine and weights) rather than its own slots in the running engine:
the sampling engine swaps in every new version between calls, but an evaluation must decode every token
with the weights of the version it evaluates. The eval engine therefore holds its own copy of that
version's weights while an evaluation runs (one extra copy of the weights on the sampler's devices), and
its slots, cache and greedy settings stay out of the sampling engine's admission.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxrl_async.sampler import Engine, Request, SamplerConfig, SamplerLoop


def eval_sampler_config(cfg: SamplerConfig, data: int, max_slots: int = 64) -> SamplerConfig:
    """The greedy eval engine's settings: the sampler's, greedy, with at most `max_slots` slots (a multiple
    of the sampler mesh's data axis `data`), each as long as the sampler's."""
    slots = data * max(1, min(cfg.num_slots, max_slots) // data)
    return dataclasses.replace(
        cfg, temperature=0.0, top_k=0, top_p=1.0, num_slots=slots, token_budget=slots * cfg.slot_len
    )


class Evaluation:
    """One evaluation of one policy version, advanced one generate call at a time (see the module
    docstring).

    Args:
      engine: a greedy engine (temperature 0) on the sampler mesh with weights of its own.
      rewards: the RewardService; its results for this evaluation carry keys ("eval", version, uid).
      tokenizer: decodes completions.
      prompts: jaxrl_async.data.Prompt records; `accuracy` weighs each by its `weight`.
      params: the version's weights in the sampler layout (None: the engine's current weights).
      version: their policy version.
    """

    def __init__(self, engine: Engine, rewards, tokenizer, prompts, params, version: int):
        if params is not None:
            engine.update_params(params, version)
        self.version, self.rewards, self.tokenizer = version, rewards, tokenizer
        self.loop = SamplerLoop(engine)
        for p in prompts:
            tokens = tuple(int(t) for t in p.tokens)
            self.loop.add_request(Request(uid=p.uid, prompt_tokens=tokens, metadata=p))
        self.total = len(prompts)
        self.weights = {p.uid: float(p.weight) for p in prompts}
        self.total_weight = sum(self.weights.values())
        self.correct = 0
        self.correct_weight = 0.0
        self.graded = 0
        self.started = time.perf_counter()
        self.calls = 0

    def owns(self, request_id) -> bool:
        """Whether a reward result belongs to this evaluation."""
        return isinstance(request_id, tuple) and request_id[:2] == ("eval", self.version)

    def step(self) -> None:
        """One generate call; finished completions go to the reward service."""
        for c in self.decode():
            text, meta = self.tokenizer.decode(c.tokens), dict(c.metadata.metadata)
            self.rewards.submit(("eval", self.version, c.uid), c.metadata.text, text, meta)

    def decode(self) -> list:
        """One generate call (none once every prompt is decoded); its finished completions. The members of
        a replica that spans processes run this where the leader runs `step` (they grade nothing)."""
        if self.loop.idle:
            return []
        self.calls += 1
        return self.loop.step()

    def take(self, request_id, reward: float) -> None:
        """One graded completion (`request_id`: the reward service's ("eval", version, uid))."""
        self.graded += 1
        self.correct += reward >= 1.0
        self.correct_weight += self.weights[request_id[2]] * (reward >= 1.0)

    @property
    def done(self) -> bool:
        return self.graded == self.total

    def close(self) -> None:
        """Releases what the evaluation holds beside the engine (nothing here; episodes: their threads)."""

    @property
    def accuracy(self) -> float:
        """The weighted fraction of prompts right (the plain fraction when every weight is 1)."""
        return self.correct_weight / self.total_weight if self.total_weight else 0.0


def evaluate_accuracy(
    engine: Engine, rewards, tokenizer, prompts, sampler_params, version: int | None = None
) -> float:
    """The fraction of `prompts` (weighted by `Prompt.weight`) whose greedy completion gets reward >= 1, all
    at once (blocking: for tools outside the event loop; the actor uses `Evaluation`). Arguments as for
    `grade_greedy`."""
    return weighted_accuracy(grade_greedy(engine, rewards, tokenizer, prompts, sampler_params, version))


def grade_greedy(engine: Engine, rewards, tokenizer, prompts, sampler_params, version: int | None = None):
    """[(prompt, reward)] of every prompt's greedy completion, in the order they finished.

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
    return list(zip([c.metadata for c in completions], rewards.grade_batch(items), strict=True))


def weighted_accuracy(graded) -> float:
    """The `Prompt.weight`-weighted fraction of [(prompt, reward)] with reward >= 1 (0 when empty)."""
    if not graded:
        return 0.0
    return float(np.average([r >= 1.0 for _, r in graded], weights=[float(p.weight) for p, _ in graded]))


def accuracy_by_length(graded, tokenizer) -> dict[str, dict]:
    """`weighted_accuracy` per band of the reference answer's length in tokens (1, 2-3, 4-7, 8-15, ...:
    powers of two, where a long-tailed task's difficulty usually sits), each with its share of the total
    weight and its number of prompts; keys are the bands as "lo-hi" (or "lo" for one length)."""
    bands: dict[int, list] = {}
    for prompt, reward in graded:
        n = max(1, len(tokenizer.encode(prompt.answer)))
        bands.setdefault(n.bit_length(), []).append((prompt, reward))
    total = sum(float(p.weight) for p, _ in graded) or 1.0
    out = {}
    for b in sorted(bands):
        lo, hi = 2 ** (b - 1), 2**b - 1
        rows = bands[b]
        key = str(lo) if lo == hi else f"{lo}-{hi}"
        share = sum(float(p.weight) for p, _ in rows) / total
        out[key] = {"accuracy": weighted_accuracy(rows), "weight": share, "prompts": len(rows)}
    return out


def trainer_idle_during(eval_spans, step_spans) -> dict:
    """How much of the evaluations' wall time the trainer spent without a step in flight, beside the same
    fraction outside them (the trainer also idles while it waits for rollouts).

    Args:
      eval_spans: (version, start, end) of each evaluation (time.monotonic, the actor's `eval_spans`).
      step_spans: (version, dispatched, finished) of each train step (the learner's `step_spans`).
    Returns {"eval_s", "trainer_busy_s", "trainer_idle_frac", "trainer_idle_frac_outside",
    "versions_trained"}: the last counts the train steps that finished while an evaluation was running.
    """
    steps = list(step_spans or ())
    total = busy = 0.0
    trained = 0
    for _, start, end in eval_spans or ():
        total += end - start
        for _, a, b in steps:
            busy += max(0.0, min(b, end) - max(a, start))
            trained += start < b < end
    outside = busy_all = 0.0
    if steps:
        outside = steps[-1][2] - steps[0][1]  # the training span
        busy_all = sum(b - a for _, a, b in steps)
        for _, start, end in eval_spans or ():
            outside -= max(0.0, min(end, steps[-1][2]) - max(start, steps[0][1]))
    return {
        "eval_s": total,
        "trainer_busy_s": busy,
        "trainer_idle_frac": 1.0 - busy / total if total else 0.0,
        "trainer_idle_frac_outside": 1.0 - (busy_all - busy) / outside if outside > 0 else 0.0,
        "versions_trained": trained,
    }
