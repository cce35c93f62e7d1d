"""Actor 0's evaluation schedule: which versions are due, one evaluation at a time beside sampling (each an
`evaluation.Evaluation`, advanced one generate call per round of the actor's event loop), the versions
that come due while one runs (waiting, each holding a copy of its weights, or skipped when the eval
engine shares the sampler's weights), and what the finished ones measured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from jaxrl_async.run_config import EvalSection
from jaxrl_async.runtime.evaluation import Evaluation
from jaxrl_async.runtime.messages import EvalResult, MemberEvaluate

log = logging.getLogger(__name__)


class EvalSchedule:
    """When and what actor 0 evaluates (see the module docstring).

    Args:
      cfg: the run's EvalSection (when a version is due; whether the eval engine shares the weights).
      last_version: the run's last version (schedule.total_steps), always evaluated.
      engine: the greedy eval engine (same sampler mesh as the sampling engine).
      rewards: the reward service (grades the held-out completions with the rollouts').
      tokenizer: decodes completions for grading.
      prompts: the held-out prompts (empty: every evaluation finishes at once with accuracy 0).
      send: delivers each finished evaluation's `EvalResult` (to the learner).
      tell: forwards a command to the members of a replica that spans processes (they run every
        evaluation's generate calls with this process).
      scorer: `params -> ExpectedReward` (runtime/expected_reward.py), or None where the task, the
        sampling or the layout allows no exact figure; an evaluation with weights of its own reports it.
    """

    def __init__(self, cfg: EvalSection, last_version: int, engine, rewards, tokenizer, prompts,
                 send: Callable[[EvalResult], None], tell: Callable[[Any], None],
                 scorer: Callable | None = None, evaluation: Callable = Evaluation):  # fmt: skip
        self.cfg, self.last_version, self.scorer = cfg, last_version, scorer
        self._evaluation = evaluation
        self._expected = None  # the running evaluation's expected reward (ExpectedReward), if scored
        self.engine, self.rewards, self.tokenizer, self.prompts = engine, rewards, tokenizer, prompts
        self._send, self._tell = send, tell
        self.running: Evaluation | None = None  # the evaluation in progress
        self._waiting: list[tuple[int, Any]] = []  # (version, params) due while one ran
        self._began = 0.0  # time.monotonic() when the running one started (for `spans`)
        self.seconds = 0.0  # wall time of the finished evaluations
        self.results: list[tuple[int, float]] = []  # (version, accuracy)
        self.spans: list[tuple[int, float, float]] = []  # (version, start, end), time.monotonic
        self.skipped: list[int] = []  # versions due but not evaluated (config.eval_weights='shared')
        self.sample_calls_during = 0  # sampling generate calls made while an evaluation was running

    def due(self, version: int) -> bool:
        return self.cfg.due(version, self.last_version)

    def add(self, version: int, params, sampling_version: int | None) -> None:
        """Starts evaluating `version` now, or after the evaluations in progress and waiting (each waiting
        one holds its version's weights: say so when they pile up). With shared weights nothing holds a
        version: one due while another evaluation runs is skipped (logged), except the last version.
        `sampling_version` is the version the sampling engine decodes with now."""
        if self.cfg.shares_weights:
            params = None  # the eval engine decodes with the sampler's weights, as they are now
            if self.running is not None and version != self.last_version:
                log.warning("evaluation of version %d skipped: version %d's is still running "
                            "(config.eval_weights='shared' keeps no copy of its weights)",
                            version, self.running.version)  # fmt: skip
                self.skipped.append(version)
                return
        if self.running is None:
            # Scored before the eval engine takes the weights (its layout change may donate them).
            scored = self.scorer is not None and params is not None
            self._expected = self.scorer(params) if scored else None
            self._tell(MemberEvaluate(version, own_weights=params is not None))
            self.running = self._evaluation(self.engine, self.rewards, self.tokenizer, self.prompts, params,
                                            version)  # fmt: skip
            self._began = time.monotonic()
            if self.running.done:  # no held-out prompts: nothing to wait for
                self._finish(sampling_version)
            return
        self._waiting.append((version, params))
        if len(self._waiting) > 1:
            log.warning("evaluations fall behind: versions %s wait for version %d's (each holds a copy of "
                        "its weights; raise config.eval_every or lower config.eval_prompts)",
                        [v for v, _ in self._waiting], self.running.version)  # fmt: skip

    def step(self, sampling_version: int | None = None) -> bool:
        """The running evaluation's generate call for this round; False if none runs. An evaluation can
        finish here when its last prompts needed no grading (an episode that ended without an answer)."""
        if self.running is None:
            return False
        self.running.step()
        if self.running.done:
            self._finish(sampling_version)
        return True

    def take(self, request_id, reward: float, sampling_version: int | None) -> bool:
        """Takes a graded completion if it belongs to the running evaluation (True), finishing it when it
        was the last; False if the result is not an evaluation's."""
        if self.running is None or not self.running.owns(request_id):
            return False
        self.running.take(request_id, reward)
        if self.running.done:
            self._finish(sampling_version)
        return True

    def _finish(self, sampling_version: int | None) -> None:
        ev, self.running = self.running, None
        ev.close()
        seconds = time.perf_counter() - ev.started
        if self.cfg.shares_weights and sampling_version != ev.version:
            log.info("the evaluation of version %d decoded with versions %d..%d (config.eval_weights="
                     "'shared')", ev.version, ev.version, sampling_version)  # fmt: skip
        self.seconds += seconds
        self.results.append((ev.version, ev.accuracy))
        self.spans.append((ev.version, self._began, time.monotonic()))
        e = self._expected
        self._send(EvalResult(ev.version, ev.accuracy, seconds, expected_reward=e and e.mean,
                              expected_reward_stderr=e and e.stderr))  # fmt: skip
        if self._waiting:
            self.add(*self._waiting.pop(0), sampling_version)
