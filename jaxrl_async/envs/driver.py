"""Runs many multi-turn episodes at once on one SamplerLoop: the model's turns decode with continuous
batching, each finished turn parks its slot (`Request.park`), the environment answers off the decode loop
(a thread pool: a tool that takes seconds holds its episode's slot, not the loop), and the observation is
appended to the parked slot (`SamplerLoop.resume`: a prefill of the observation, not of the context).

What happens when every slot is parked: the loop dispatches no decode call and admits into free slots
only, so new episodes start while others wait for their tools; with no free slot either, `step` just
collects the environments' answers (the caller's poll loop waits on them).

An environment's answer has a deadline (`EnvConfig.step_timeout_s`, from the end of the turn it
answers): past it the episode ends as `env_timeout`, reward 0, counted with the environments that raised
(`env_errors`), and its slot is freed. The environment is made (`make_env(row)`) on the driver's threads
at its first answer, so a factory that hangs or raises is bounded and counted the same way. A Python
thread cannot be killed: a stuck step keeps its worker until it returns (`stuck` counts them). So that
stuck workers do not starve the other episodes, the pool is replaced at each one while at most `workers`
are stuck: a fresh pool takes new steps and those still queued (each with a fresh deadline: it has not
run), and the old pool's threads exit once they return. Past that nothing more is replaced (the threads
stay bounded, about twice `workers`): steps queue behind the stuck ones and end at their own deadlines,
so every episode still ends. The threads are daemons (`DaemonPool`): a stuck one does not hold the
process at exit.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxrl_async.envs.config import EnvConfig
from jaxrl_async.envs.env import Encoder, StepResult
from jaxrl_async.envs.episode import Episode, observe
from jaxrl_async.envs.workers import DaemonPool
from jaxrl_async.sampler.loop import Request, SamplerLoop


@dataclasses.dataclass
class _Running:
    episode: Episode
    row: Any  # what `make_env` makes the episode's environment of
    env: Any = None  # made on a driver thread at the first answer (a factory that hangs is bounded too)
    future: concurrent.futures.Future | None = None  # the environment's answer to the last turn
    turn: str = ""  # the last turn's text (a step still queued when its pool is replaced is resubmitted)
    deadline: float = 0.0  # time.monotonic() past which the pending answer is an `env_timeout`


class EpisodeDriver:
    """Multi-turn episodes on a SamplerLoop (see the module docstring).

    Args:
      loop: the sampler loop (its engine decides the caches and limits).
      cfg: the episode bounds (turns, observation tokens, episode tokens).
      tokenizer: decodes turns for the environments, encodes their text observations.
      make_env: row -> environment (one per sample: a GRPO group's samples get one each), called on the
        driver's threads when the episode's first turn ends (bounded by cfg.step_timeout_s like a step).
      workers: threads that run environment steps (stuck ones are replaced, up to `workers` of them).
      max_turn_tokens: tokens one turn may generate (None: the engine's max_new_tokens).
      on_answer: called with (episode, StepResult) as each environment's answer is applied, before the
        episode takes it (a run's schedule log records the answers: `runtime/schedule_log.py`).
    """

    def __init__(self, loop: SamplerLoop, cfg: EnvConfig, tokenizer, make_env: Callable, workers: int = 4,
                 max_turn_tokens: int | None = None, on_answer: Callable | None = None):  # fmt: skip
        self.loop, self.cfg, self.tokenizer, self.make_env = loop, cfg, tokenizer, make_env
        self.on_answer = on_answer
        self.max_turn_tokens = max_turn_tokens or loop.cfg.max_new_tokens
        self.encoder = Encoder(tokenizer)
        self.workers = workers
        self._pool = self._new_pool()
        self._running: dict[tuple, _Running] = {}
        self.env_errors = 0  # environments that raised or timed out (the episode ends, reward 0)
        self.env_timeouts = 0  # of those, answers past cfg.step_timeout_s
        self.stuck = 0  # abandoned steps whose threads still run (a worker's done-callback decrements it)
        self._lock = threading.Lock()  # guards `stuck`

    @property
    def in_flight(self) -> int:
        """Episodes started and not finished."""
        return len(self._running)

    def add(self, uid, row, prompt_tokens, n_samples: int = 1, seed: int = 0) -> None:
        """Starts `n_samples` episodes of one row (each with its own environment)."""
        budget = min(self.max_turn_tokens, self.cfg.max_episode_tokens)
        self.loop.add_request(Request(uid, tuple(prompt_tokens), n_samples, seed, budget, park=True))
        for i in range(n_samples):
            episode = Episode(np.asarray(prompt_tokens, np.int32), uid=uid, sample_index=i)
            self._running[(uid, i)] = _Running(episode, row)

    def step(self) -> list[Episode]:
        """One decode call; hands finished turns to their environments and appends the answers that
        arrived. Returns the episodes that ended."""
        for c in self.loop.step():
            run = self._running[(c.uid, c.sample_index)]
            run.episode.add_turn(c.tokens, c.logprobs, c.versions)
            run.turn = self.tokenizer.decode(c.tokens)
            run.deadline = time.monotonic() + self.cfg.step_timeout_s
            run.future = self._pool.submit(self._env_step, run, run.turn)
        finished = []
        for key, run in list(self._running.items()):
            if run.future is not None and run.future.done() and self._answer(key, run):
                finished.append(run.episode)
        return finished + self._expire()

    def _expire(self) -> list[Episode]:
        """Ends the episodes whose environments are past their deadline; returns them."""
        now = time.monotonic()
        late = [(k, r) for k, r in self._running.items() if r.future is not None and now >= r.deadline]
        # Running steps first: replacing their stuck pool resubmits the queued ones with a fresh deadline.
        late.sort(key=lambda item: not item[1].future.running())
        ended = []
        for key, run in late:
            if run.future is not None and not run.future.done() and now >= run.deadline:
                if self._time_out(key, run):
                    ended.append(run.episode)
        return ended

    def _env_step(self, run: _Running, turn: str) -> StepResult:
        """On a driver thread: the episode's environment (made at its first answer) answers `turn`."""
        if run.env is None:
            run.env = self.make_env(run.row)
        return run.env.step(turn)

    def _new_pool(self) -> DaemonPool:
        return DaemonPool(self.workers)

    def _time_out(self, key: tuple, run: _Running) -> bool:
        """Ends an episode whose environment did not answer by its deadline (`env_timeout`, reward 0)."""
        future, run.future = run.future, None
        if not future.cancel():  # it runs: its thread is stuck until the environment returns
            self._abandon(future)
        self.env_errors += 1
        self.env_timeouts += 1
        return self.apply(key, StepResult(None, 0.0, True, {"reason": "env_timeout"}))

    def _abandon(self, future) -> None:
        """Counts a stuck step until its thread returns; replaces the pool while at most `workers` are
        stuck (see the module docstring)."""
        with self._lock:
            self.stuck += 1
            replace = self.stuck <= self.workers
        future.add_done_callback(self._returned)
        if not replace:
            return
        old, self._pool = self._pool, self._new_pool()
        old.shutdown()  # its healthy threads finish what they run, then exit
        for run in self._running.values():  # steps queued in an old pool move to the new one
            queued = run.future
            if isinstance(queued, concurrent.futures.Future) and queued.cancel():
                # It never ran (it waited behind stuck workers): its environment gets its whole time.
                run.deadline = time.monotonic() + self.cfg.step_timeout_s
                run.future = self._pool.submit(self._env_step, run, run.turn)

    def _returned(self, _future) -> None:
        with self._lock:
            self.stuck -= 1

    @property
    def waiting(self) -> bool:
        """Some environment is still answering a turn (its episode's slot stays parked until it does)."""
        return any(r.future is not None for r in self._running.values())

    def wait(self, timeout_s: float) -> None:
        """Blocks until an environment answers or `timeout_s` passes (a caller with nothing to decode
        sleeps here instead of spinning); it wakes at the first answer's deadline too."""
        self._wait_pending(timeout_s)

    def _wait_pending(self, timeout_s: float | None) -> None:
        pending = [r for r in self._running.values() if r.future is not None]
        if pending:
            left = min(r.deadline for r in pending) - time.monotonic()
            timeout_s = left if timeout_s is None else min(timeout_s, left)
            concurrent.futures.wait([r.future for r in pending], max(0.0, timeout_s),
                                    return_when=concurrent.futures.FIRST_COMPLETED)  # fmt: skip

    def run(self) -> list[Episode]:
        """Steps until every episode added so far has ended."""
        out = []
        while self._running:
            out += self.step()
            pending = [r.future for r in self._running.values() if r.future is not None]
            if self.loop.stuck and not pending:
                raise RuntimeError(
                    "episodes cannot go on: their resumes wait for KV pages that no running sequence will "
                    "free (give the paged cache more pages: config.sampler.token_budget)"
                )
            if self.loop.idle and pending:  # only environments are working: wait for one (or a deadline)
                self._wait_pending(None)
        return out

    def _answer(self, key: tuple, run: _Running) -> bool:
        """Applies the environment's answer; True when the episode ended (its slot is freed)."""
        future, run.future = run.future, None
        try:
            result = future.result()
        except Exception:  # a user environment's bug ends its episode, never the run
            self.env_errors += 1
            result = StepResult(None, 0.0, True, {"reason": "env_error"})
        return self.apply(key, result)

    def apply(self, key: tuple, result: StepResult) -> bool:
        """Applies `result` to the parked episode `key` (resumes its slot, or ends the episode); True when
        the episode ended. A replay calls it with the answers the run recorded."""
        episode = self._running[key].episode
        if self.on_answer is not None:
            self.on_answer(episode, result)
        before = episode.length
        goes_on = observe(episode, result, self.cfg, self.encoder)
        observation = episode.tokens[before:]
        context = len(episode.prompt_tokens) + before
        budget = min(self.max_turn_tokens, self.cfg.max_episode_tokens - episode.length,
                     self.loop.engine.capacity - context - len(observation))  # fmt: skip
        if goes_on and (not observation or budget < 1):
            goes_on, episode.finish_reason = False, "no_observation" if not observation else "capacity"
        if goes_on:
            try:
                self.loop.resume(*key, observation, budget)
                return False
            except ValueError:  # the context outgrew what the cache can continue (e.g. paged max_prompt_len)
                episode.finish_reason = "capacity"
        self.loop.finish(*key)
        del self._running[key]
        return True

    def close(self) -> None:
        self._pool.shutdown(cancel=True)
