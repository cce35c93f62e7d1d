"""The actor: one sampler replica. It starts the prompts the coordinator grants, decodes them with
continuous batching, grades the completions, sends finished groups to the learner, and swaps in each new
policy version between decode calls (in flight). Actor 0 also measures held-out accuracy, on its own
schedule beside sampling (`evaluation.Evaluation`: one greedy generate call per round, with the weights of
the version under evaluation), so neither sampling nor, in one process, training waits for it.

One `poll()` is one round of its event loop: read messages, start receiving new versions and swap in those
that have fully arrived, ask for prompts, run one generate call, hand completions to the reward service
and finished groups to the learner. It never blocks on another role: everything it needs arrives as
messages, and a version in transit lands on the sampler's devices while it decodes on with the one it has
(it waits for a version only when it has nothing else to do).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxrl_async.rewards import RewardConfig
from jaxrl_async.rewards.shaping import overlong_penalty
from jaxrl_async.rollouts import Rollout
from jaxrl_async.run_config import EvalSection, Schedule
from jaxrl_async.runtime.evaluation import Evaluation
from jaxrl_async.runtime.messages import (
    ActorStats,
    EvalResult,
    MemberApply,
    MemberEvaluate,
    MemberReceive,
    NewWeights,
    Rollouts,
    Stop,
    Stopped,
    TicketRequest,
    Tickets,
)
from jaxrl_async.runtime.replica import as_member_request
from jaxrl_async.runtime.weight_sync import Incoming, checksum
from jaxrl_async.sampler import Request, SamplerLoop

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ActorConfig:
    """What an actor needs to know of the run.

    Attributes:
      index: this actor's number (0 measures held-out accuracy).
      seed: the run's seed (each prompt's sampling stream derives from it and the group id).
      schedule: the run's Schedule (samples_per_prompt = G; total_steps = the last version, always
        evaluated).
      eval: the run's EvalSection (when actor 0 evaluates; whether the eval engine shares the sampler's
        weights).
      reward: the run's RewardConfig (the overlong shaping added to each reward).
      verify_weights: checksum every received version (a host read of the weights; for tests).
      actors: how many actors share the run's prompts (this one's share of a step sizes its queue).
    """

    index: int
    seed: int
    schedule: Schedule
    eval: EvalSection
    reward: RewardConfig
    verify_weights: bool = False
    actors: int = 1


def to_rollout(c, reward: float, reason: str, tokenizer, shaping: float = 0.0) -> Rollout:
    """A graded sampler Completion (its metadata is the Prompt) as a trainer Rollout; `shaping` (the
    overlong term) is added to the verifier's reward and kept in the metadata."""
    return Rollout(
        uid=c.metadata.uid,
        group_id=int(c.uid),
        sample_index=int(c.sample_index),
        prompt_tokens=np.asarray(c.prompt_tokens, np.int32),
        completion_tokens=np.asarray(c.tokens, np.int32),
        behav_logprobs=np.asarray(c.logprobs, np.float32),
        versions=np.asarray(c.versions, np.int32),
        reward=float(reward) + shaping,
        finish_reason=c.finish_reason,
        metadata={
            "text": tokenizer.decode(c.tokens),
            "prompt": c.metadata.text,
            "reason": reason,
            "overlong_penalty": shaping,
        },  # fmt: skip
    )


class Actor:
    """A sampler replica (see the module docstring).

    Args:
      cfg: the actor's settings.
      engine, eval_engine: the sampling engine and the greedy one for evaluation (same sampler mesh).
      rewards: the reward service (its worker processes grade while the actor decodes).
      tokenizer: decodes completions for grading and logs.
      eval_prompts: held-out prompts (actor 0 only).
      eval_engine: greedy, with weights of its own (an evaluation keeps its version while the sampling
        engine swaps in newer ones).
      transport: the run's transport; this role reads "actor:<index>".
      weights: receives published versions (`LocalWeights` or `TransferReceiver`).
      max_new_tokens_fn: optional group id -> generation cap (benchmarks impose a length distribution).
      members: the leader's channel to the other processes of a replica that spans several
        (`replica.Members`): every command goes to them before this process runs it on the mesh.
      executables: the `compile_cache.ExecutableStore` the engines compile through, if any (its counts
        go in the final report).
    """

    def __init__(self, cfg: ActorConfig, engine, eval_engine, rewards, tokenizer, eval_prompts, transport,
                 weights, max_new_tokens_fn: Callable[[int], int] | None = None, members=None,
                 executables=None):  # fmt: skip
        self.cfg, self.engine, self.eval_engine = cfg, engine, eval_engine
        self.rewards, self.tokenizer, self.eval_prompts = rewards, tokenizer, eval_prompts
        self.transport, self.weights, self.max_new_tokens_fn = transport, weights, max_new_tokens_fn
        self.endpoint = f"actor:{cfg.index}"
        self.executables = executables
        self.loop = SamplerLoop(engine)
        # Prompts to keep queued beyond the free slots: two engines' worth plus this actor's share of a
        # step. The coordinator answers from the learner's process, whose train step holds its cores, so
        # an answer can come a step late and the queue must outlast that step. On letter_range a quarter
        # of an engine left the trainer idle 31% of the time, two engines 16-19%, and two engines plus a
        # step 4-7.5% (pinned, and with the sampler's core lent to the learner; docs/benchmarks.md): with
        # less the sampler never got a whole step ahead, whatever η allowed. The η bound still caps what
        # is granted: this changes when prompts start, not how stale they may be.
        engines = math.ceil(2 * engine.cfg.num_slots / cfg.schedule.samples_per_prompt)
        self.lookahead = max(1, engines + math.ceil(cfg.schedule.prompts_per_step / cfg.actors))
        log.info("actor %d: keeps %d prompts queued beyond its free slots", cfg.index, self.lookahead)
        self.version: int | None = None  # the policy version in use (None until the first arrives)
        self.granted = 0  # prompts granted so far
        self.asked = 0  # prompts asked for and not yet granted
        self.exhausted = False
        self.done = False  # Stop arrived (the final report is sent)
        self._pending: dict[tuple[int, int], Any] = {}  # reward request -> Completion
        self._groups: dict[int, list[Rollout]] = {}
        self._ready: list[list[Rollout]] = []
        self.sample_tokens = 0
        self.groups_sent = 0  # for the stall warning: where groups stop
        self.idle_s = 0.0
        self.sample_calls_during_eval = 0  # sampling generate calls made while an evaluation was running
        self._idle_since: float | None = None
        self._started = time.perf_counter()  # the clock of idle_s (ActorStats.wall_s)
        self.eval_s = 0.0
        self.weight_s = 0.0
        self.checksums: dict[int, float] = {}
        self.evals: list[tuple[int, float]] = []
        self._eval: Evaluation | None = None  # the evaluation in progress
        self._eval_due_next: list[tuple[int, Any]] = []  # (version, params) due while one ran
        self.eval_spans: list[tuple[int, float, float]] = []  # (version, start, end), time.monotonic
        self.evals_skipped: list[int] = []  # versions due but not evaluated (config.eval_weights='shared')
        self._drained_sent = False
        self.members = members
        self._queued: list = []  # MemberRequests queued since the members' last step
        self._arriving: list[tuple[Incoming, bool]] = []  # versions on their way (and whether due)
        self.applied_at: dict[int, int] = {}  # version -> decode steps run before it (a spanning replica)

    # ----- the event loop -----

    def poll(self) -> bool:
        """One round (see the module docstring); False if there was nothing to do."""
        if self.members is None:
            return self._poll()
        try:
            return self._poll()
        except Exception as e:  # noqa: BLE001 - a member that died shows here as a broken collective
            raise self.members.explain(e) from e

    def _poll(self) -> bool:
        t0 = time.perf_counter()
        new: list[NewWeights] = []
        for m in self.transport.recv(self.endpoint):
            if isinstance(m, Tickets):
                self._start(m)
            elif isinstance(m, NewWeights):
                new.append(m)
            elif isinstance(m, Stop):
                self.done = True
            else:
                raise TypeError(f"{self.endpoint}: unexpected message {type(m).__name__}")
        if self.done:
            final = self.stats(final=True)
            if self.members is not None:  # a replica that spans processes: what each member did
                final.replica = {
                    "applied_at": dict(self.applied_at),
                    "tokens_generated": self.loop.stats.tokens_generated,
                    "pulled_bytes": int(getattr(self.weights, "last_bytes", 0)),
                    "members": self.members.stop(),
                }
            if self.executables is not None:
                final.executables = self.executables.report()
            self.transport.send("learner", Stopped(self.cfg.index, final))
            return True
        if new:
            self._arrive(new)
        if self._arriving:
            self._take_arrived(block=self.version is None)  # nothing to sample with yet: wait for it
        if self.version is None:
            return bool(new)
        self._ask()
        if self._eval is not None and not self.loop.idle:
            self.sample_calls_during_eval += 1
        if self.members is not None:  # the members run this round's calls with this process
            self.members.step(self._queued, evaluate=self._eval is not None)
            self._queued = []
        completions = self.loop.step(self._admit_none)
        active = bool(completions) or not self.loop.idle
        self._grade(completions)
        if self._eval is not None:
            self._eval.step()
            active = True
        if not active and self._arriving:  # nothing to decode: wait for the version on its way
            self._take_arrived(block=True)
            active = True
        elif not active and self._pending:  # only rewards in flight: sleep until one lands
            self.rewards.wait(0.005)
        self._collect()
        self._send()
        self._account_idle(t0, active or bool(new))
        return active or bool(new)

    def _account_idle(self, t0: float, busy: bool) -> None:
        """Wall time with nothing to decode or grade (whatever the loop did meanwhile) is idle time."""
        if busy and self._idle_since is not None:
            self.idle_s += t0 - self._idle_since
            self._idle_since = None
        elif not busy and self._idle_since is None:
            self._idle_since = t0

    def _admit_none(self):
        return None  # every request is queued by `_start`

    def _start(self, tickets: Tickets) -> None:
        self.exhausted = tickets.exhausted
        self._drained_sent = False
        self.asked = max(0, self.asked - len(tickets.prompts))
        self.granted += len(tickets.prompts)
        for gid, prompt in tickets.prompts:
            request = Request(
                uid=gid,
                prompt_tokens=tuple(int(t) for t in prompt.tokens),
                n_samples=self.cfg.schedule.samples_per_prompt,
                seed=self.cfg.seed * 1_000_003 + gid,
                max_new_tokens=self.max_new_tokens_fn(gid) if self.max_new_tokens_fn else None,
                metadata=prompt,
            )
            self.loop.add_request(request)
            if self.members is not None:
                self._queued.append(as_member_request(request))

    def _ask(self) -> None:
        """Keeps enough prompts queued to fill the free slots plus the lookahead."""
        if self.exhausted:
            return
        free = self.loop.free_slots
        queued = self.granted - self.loop.stats.requests_admitted
        want = math.ceil(free / self.cfg.schedule.samples_per_prompt) + self.lookahead - queued - self.asked
        if want > 0:
            self.asked += want
            self.transport.send("coordinator", TicketRequest(self.cfg.index, want))

    def _arrive(self, messages: list[NewWeights]) -> None:
        """Starts receiving every published version (each must be taken), oldest first; they land while
        the sampler decodes on with the version it has (`_take_arrived` swaps them in)."""
        for m in messages:
            t0 = time.perf_counter()
            due = self.cfg.index == 0 and (self.version is None or self._eval_due(m.version))
            self._tell(MemberReceive(m.version, hold=due and not self.cfg.eval.shares_weights))
            self._arriving.append((self.weights.start(m), due))
            self.weight_s += time.perf_counter() - t0

    def _take_arrived(self, block: bool) -> None:
        """Swaps in the versions that have fully arrived, in order, between two decode calls: the newest
        of them is sampled with, and actor 0 evaluates those due. With `block` (nothing else to do) it
        waits for the oldest one still on its way."""
        t0 = time.perf_counter()
        n = 0
        while n < len(self._arriving) and self.weights.ready(self._arriving[n][0]):
            n += 1
        if block and not n and self._arriving:
            n = 1
        taken, self._arriving = self._arriving[:n], self._arriving[n:]
        arrived = [(incoming.message, self.weights.finish(incoming), due) for incoming, due in taken]
        self.weight_s += time.perf_counter() - t0
        for i, (m, params, due) in enumerate(arrived):
            if self.cfg.verify_weights:
                self.checksums[m.version] = checksum(params)
            if due or i == len(arrived) - 1:
                first = self.version is None
                mode = None if first else self.engine.cfg.update_mode  # sampler.update_mode
                self._tell(MemberApply(m.version, mode))
                self.loop.update_params(params, m.version, mode)
                if self.members is not None:
                    self.applied_at[m.version] = self.loop.stats.decode_steps
                self.version = m.version
            if due:
                self._schedule_eval(m.version, params)

    def _eval_due(self, version: int) -> bool:
        return self.cfg.eval.due(version, self.cfg.schedule.total_steps)

    def _schedule_eval(self, version: int, params) -> None:
        """Starts evaluating `version` now, or after the evaluations in progress and waiting (each waiting
        one holds its version's weights: say so when they pile up). With shared weights nothing holds a
        version: one due while another evaluation runs is skipped (logged), except the last version."""
        if self.cfg.eval.shares_weights:
            params = None  # the eval engine decodes with the sampler's weights, as they are now
            if self._eval is not None and version != self.cfg.schedule.total_steps:
                log.warning("evaluation of version %d skipped: version %d's is still running "
                            "(config.eval_weights='shared' keeps no copy of its weights)",
                            version, self._eval.version)  # fmt: skip
                self.evals_skipped.append(version)
                return
        if self._eval is None:
            self._tell(MemberEvaluate(version, own_weights=params is not None))
            self._eval = Evaluation(self.eval_engine, self.rewards, self.tokenizer, self.eval_prompts, params,
                                    version)  # fmt: skip
            self._eval_began = time.monotonic()
            if self._eval.done:  # no held-out prompts: nothing to wait for
                self._eval_finished()
            return
        self._eval_due_next.append((version, params))
        if len(self._eval_due_next) > 1:
            log.warning("evaluations fall behind: versions %s wait for version %d's (each holds a copy of "
                        "its weights; raise config.eval_every or lower config.eval_prompts)",
                        [v for v, _ in self._eval_due_next], self._eval.version)  # fmt: skip

    def _tell(self, command) -> None:
        if self.members is not None:
            self.members.tell(command)

    def _eval_finished(self) -> None:
        ev, self._eval = self._eval, None
        seconds = time.perf_counter() - ev.started
        if self.cfg.eval.shares_weights and self.version != ev.version:
            log.info("the evaluation of version %d decoded with versions %d..%d (config.eval_weights="
                     "'shared')", ev.version, ev.version, self.version)  # fmt: skip
        self.eval_s += seconds
        self.evals.append((ev.version, ev.accuracy))
        self.eval_spans.append((ev.version, self._eval_began, time.monotonic()))
        self.transport.send("learner", EvalResult(ev.version, ev.accuracy, seconds))
        if self._eval_due_next:
            self._schedule_eval(*self._eval_due_next.pop(0))

    def _grade(self, completions) -> None:
        for c in completions:
            self.sample_tokens += len(c.tokens)
            key = (int(c.uid), int(c.sample_index))
            self._pending[key] = c
            prompt = c.metadata
            self.rewards.submit(key, prompt.text, self.tokenizer.decode(c.tokens), dict(prompt.metadata))

    def _collect(self) -> None:
        g = self.cfg.schedule.samples_per_prompt
        for res in self.rewards.poll():
            if self._eval is not None and self._eval.owns(res.request_id):
                self._eval.take(res.request_id, res.reward)
                if self._eval.done:
                    self._eval_finished()
                continue
            c = self._pending.pop(res.request_id)
            group = self._groups.setdefault(int(c.uid), [])
            cap, rw = self.engine.cfg.max_new_tokens, self.cfg.reward
            shaping = overlong_penalty(len(c.tokens), cap, rw.overlong_buffer, rw.overlong_penalty)
            group.append(to_rollout(c, res.reward, res.reason, self.tokenizer, shaping))
            if len(group) == g:
                del self._groups[int(c.uid)]
                group.sort(key=lambda r: r.sample_index)
                self._ready.append(group)

    def _send(self) -> None:
        drained = self.exhausted and self.loop.idle and not self._pending
        if self._ready or (drained and not self._drained_sent):
            self._drained_sent = drained
            self.transport.send("learner", Rollouts(self.cfg.index, self._ready, self.stats()))
            self.groups_sent += len(self._ready)
            self._ready = []

    # ----- reporting -----

    def describe(self) -> str:
        """One line of state, for the stall warning."""
        return (
            f"{self.endpoint}: version {self.version}, {self.loop.num_live} live / "
            f"{self.loop.free_slots} free slots, {self.granted - self.loop.stats.requests_admitted} prompts "
            f"queued, {self.asked} asked, "
            f"{len(self._pending)} rewards pending, {len(self._groups)} partial groups, "
            f"{self.groups_sent} groups sent" + (", data exhausted" if self.exhausted else "")
        )

    def stats(self, final: bool = False) -> ActorStats:
        """Counters since the start (the learner lead logs them); `final` adds the reward service's."""
        s = self.loop.stats
        now = time.perf_counter()
        return ActorStats(
            version=self.version,
            sample_tokens=self.sample_tokens,
            completions=s.completions,
            occupancy=float(s.occupancy),
            idle_s=self.idle_s + (now - self._idle_since if self._idle_since else 0.0),
            weight_s=self.weight_s,
            eval_s=self.eval_s,
            eval_spans=list(self.eval_spans),
            evals_skipped=list(self.evals_skipped),
            sample_calls_during_eval=self.sample_calls_during_eval,
            reward_errors=int(sum(self.rewards.stats()["errors"].values())),
            drained=self.exhausted and self.loop.idle and not self._pending,
            checksums=dict(self.checksums),
            reward_stats=self.rewards.stats() if final else None,
            wall_s=now - self._started,
        )
