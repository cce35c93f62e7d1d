"""An orchestrated run learns: the held-out reward of a short sync run (seeded, so deterministic) rises
far above its noise, the standard error of a held-out accuracy over its prompts.

The task is one a random tiny model can learn in a few steps, so the test is cheap: the format reward
with the pattern "the completion starts with a digit from 5 to 9". Held-out accuracy counts greedy
completions that do; the untrained model's start elsewhere (0.0), and at a learning rate of ~0 the run
stays there and the test fails (checked).
"""

import math

from jaxrl_async.runtime.orchestrator import run_from_config
from tests.test_orchestrator import _small


def test_a_short_run_raises_held_out_reward_far_above_its_noise(tmp_path):
    c = _small(tmp_path, mode="sync", total_steps=8, eval_every=8, eval_prompts=64, prompts_per_step=8,
               **{"reward.defaults": {"format_regex": "^[5-9]"}, "trainer.lr": 3e-3,
                  "trainer.warmup_steps": 0})  # fmt: skip
    summary = run_from_config(c)
    evals = {e["step"]: e["accuracy"] for e in summary["evals"]}
    assert sorted(evals) == [0, 8], evals
    first, last = evals[0], evals[8]
    # The standard error of a held-out accuracy of 64 prompts is at most 0.5 / 8 = 0.0625.
    noise = math.hypot(*(math.sqrt(max(a * (1 - a), 1 / 64) / 64) for a in (first, last)))
    assert last - first > 4 * noise, (first, last, noise)
    assert first < 0.5 < last, (first, last)  # e.g. 0.0 -> 1.0
