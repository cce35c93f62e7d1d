"""The actor: one sampler replica. It starts the prompts the coordinator grants, decodes them with
continuous batching, grades the completions, sends finished groups to the learner, and swaps in each new
policy version between decode calls (in flight). Actor 0 also measures held-out accuracy, on its own
schedule beside sampling (`eval_schedule.EvalSchedule`: one greedy generate call per round, with the
weights of the version under evaluation), so neither sampling nor, in one process, training waits for it.

One `poll()` is one round of its event loop: read messages, start receiving new versions and swap in those
that have fully arrived, ask for prompts, run one generate call, hand completions to the reward service
and finished groups to the learner. It never blocks on another role: everything it needs arrives as
messages, and a version in transit lands on the sampler's devices while it decodes on with the one it has
(it waits for a version only when it has nothing else to do).

Its parts: `tickets.TicketBook` (prompts asked for and granted), `rollout_groups.GroupAssembly`
(completions to graded groups), `arrivals.Arrivals` (versions in transit) and the `EvalSchedule`. With
config.env enabled, `episodes.EpisodeRunner` runs each granted prompt's samples as multi-turn episodes and
its step replaces the loop's (and evaluations are greedy episodes); everything else is the same.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from jaxrl_async.run_config import RunConfig
from jaxrl_async.runtime.arrivals import Arrivals
from jaxrl_async.runtime.cluster import Roles
from jaxrl_async.runtime.episodes import EpisodeRunner, evaluation_for, sample_round, sampling_idle
from jaxrl_async.runtime.eval_schedule import EvalSchedule
from jaxrl_async.runtime.expected_reward import scorer
from jaxrl_async.runtime.messages import (
    ActorStats,
    MemberApply,
    MemberReceive,
    NewWeights,
    Rollouts,
    Stop,
    Stopped,
    TicketRequest,
    Tickets,
)
from jaxrl_async.runtime.metrics import IdleClock
from jaxrl_async.runtime.rollout_groups import GroupAssembly
from jaxrl_async.runtime.schedule_log import NoSchedule
from jaxrl_async.runtime.tickets import TicketBook
from jaxrl_async.sampler import SamplerLoop

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ActorConfig:
    """What an actor needs to know of the run: its place among the actors, and the run's settings (it
    reads the seed, which seeds each prompt's sampling stream with the group id; the schedule; the eval
    section; the reward's overlong shaping; verify_weights).

    Attributes:
      index: this actor's number (0 measures held-out accuracy).
      run: the run's RunConfig.
      roles: which process plays which role.
    """

    index: int
    run: RunConfig
    roles: Roles

    @property
    def actors(self) -> int:
        """How many actors share the run's prompts (this one's share of a step sizes its queue)."""
        return len(self.roles.samplers)


class Actor:
    """A sampler replica (see the module docstring).

    Args:
      cfg: the actor's settings.
      engine, eval_engine: the sampling engine and the greedy one for evaluation (same sampler mesh; the
        eval engine has weights of its own, so an evaluation keeps its version while the sampling engine
        swaps in newer ones).
      rewards: the reward service (its worker processes grade while the actor decodes).
      tokenizer: decodes completions for grading and logs.
      eval_prompts: held-out prompts (actor 0 only).
      transport: the run's transport; this role reads "actor:<index>".
      weights: receives published versions (`LocalWeights` or `TransferReceiver`).
      max_new_tokens_fn: optional group id -> generation cap (benchmarks impose a length distribution).
      members: the leader's channel to the other processes of a replica that spans several
        (`replica.Members`): every command goes to them before this process runs it on the mesh.
      executables: the `compile_cache.ExecutableStore` the engines compile through, if any (its counts
        go in the final report).
      schedule: records the decisions timing makes (`schedule_log.ActorSchedule`); None: none.
    """

    def __init__(self, cfg: ActorConfig, engine, eval_engine, rewards, tokenizer, eval_prompts, transport,
                 weights, max_new_tokens_fn: Callable[[int], int] | None = None, members=None,
                 executables=None, schedule=None):  # fmt: skip
        self.cfg, self.engine, self.rewards, self.tokenizer = cfg, engine, rewards, tokenizer
        self.schedule = schedule or NoSchedule()
        self.transport, self.members, self.executables = transport, members, executables
        self.loop = SamplerLoop(engine)
        run = cfg.run
        self.tickets = TicketBook(cfg.index, run.seed, run.schedule, engine.cfg.num_slots, cfg.actors,
                                  max_new_tokens_fn)  # fmt: skip
        self.groups = GroupAssembly(run.schedule.samples_per_prompt, run.reward, engine.cfg.max_new_tokens,
                                    rewards, tokenizer)  # fmt: skip
        self.arrivals = Arrivals(weights, run.verify_weights)
        send = lambda m: transport.send("learner", m)  # noqa: E731
        # Multi-turn episodes (config.env): the runner steps the loop; evaluations are greedy episodes.
        self.episodes = (EpisodeRunner(run.env, self.loop, tokenizer, members, self.schedule)
                         if run.env.enabled else None)  # fmt: skip
        # The exact expected reward needs the version's whole weights in this process (not in a replica that
        # spans processes: its forward pass would need every member) and single-turn completions.
        score = None if members or self.episodes else scorer(run.reward.reward, engine.cfg, engine.model_cfg,
                                                             eval_prompts, tokenizer)  # fmt: skip
        self.eval_schedule = EvalSchedule(run.eval, run.schedule.total_steps, eval_engine, rewards, tokenizer,
                                          eval_prompts, send, self._tell, score,
                                          evaluation_for(run.env, members))  # fmt: skip
        self.version: int | None = None  # the policy version in use (None until the first arrives)
        self.done = False  # Stop arrived (the final report is sent)
        self.idle = IdleClock()  # ActorStats.idle_s and wall_s

    @property
    def endpoint(self) -> str:
        return f"actor:{self.cfg.index}"

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
            self.transport.send("learner", Stopped(self.cfg.index, self._final_stats()))
            return True
        for m in new:  # every published version must be taken, oldest first; each lands while we decode
            due = self.cfg.index == 0 and (self.version is None or self.eval_schedule.due(m.version))
            self._tell(MemberReceive(m.version, due and not self.cfg.run.eval.shares_weights, m.checksum))
            self.arrivals.start(m, due)
        if self.arrivals:  # no version yet: wait for it. A spanning replica's members pull and check each
            # version when told (MemberReceive), a collective over its devices: the leader takes them then.
            self._take_arrived(block=self.version is None, every=self.members is not None)
        if self.version is None:
            return bool(new)
        self._ask()
        if self.eval_schedule.running is not None and not self.loop.idle:
            self.eval_schedule.sample_calls_during += 1
        if self.members is not None:  # the members run this round's calls (episodes: MirroredLoop's too)
            self.members.step(evaluate=self.eval_schedule.running is not None and self.episodes is None)
        self.schedule.calling(self.loop)
        active = sample_round(self.loop, self.episodes, self.groups)  # `_start` queued every request
        active = self.eval_schedule.step(self.version) or active
        if not active and self.arrivals:  # nothing to decode: wait for the version on its way
            self._take_arrived(block=True)
            active = True
        elif not active and self.episodes is not None and self.episodes.waiting:
            self.episodes.wait(0.005)  # only environments answer: sleep until one does (sampler idle time)
        elif not active and self.groups.pending:  # only rewards in flight: sleep until one lands
            self.rewards.wait(0.005)
        self._collect()
        self._send()
        self.idle.round(t0, active or bool(new))  # nothing to decode or grade: idle time
        return active or bool(new)

    def _start(self, tickets: Tickets) -> None:
        for request in self.tickets.grant(tickets):
            (self.loop if self.episodes is None else self.episodes).add_request(request)
            self.schedule.added(request)
            if self.members is not None and self.episodes is None:  # episodes: their driver's requests
                self.members.queue(request)

    def _ask(self) -> None:
        """Keeps enough prompts queued to fill the free slots plus the lookahead."""
        want = self.tickets.want(self.loop.free_slots, self.loop.stats.requests_admitted)
        if want:
            self.transport.send("coordinator", TicketRequest(self.cfg.index, want))

    def _take_arrived(self, block: bool, every: bool = False) -> None:
        """Swaps in the versions that have fully arrived, in order, between two decode calls: the newest
        of them is sampled with, and actor 0 evaluates those due (`Arrivals.take` for `block`)."""
        arrived = self.arrivals.take(block, every)
        for i, (m, params, due) in enumerate(arrived):
            if due or i == len(arrived) - 1:
                mode = None if self.version is None else self.engine.cfg.update_mode  # sampler.update_mode
                self._tell(MemberApply(m.version, mode))
                self.loop.update_params(params, m.version, mode)
                self.schedule.applied(m.version, mode, self.loop)
                if self.members is not None:
                    self.members.applied(m.version, self.loop.stats.decode_steps)
                self.version = m.version
            if due:
                self.eval_schedule.add(m.version, params, self.version)

    def _tell(self, command) -> None:
        if self.members is not None:
            self.members.tell(command)

    def _collect(self) -> None:
        for res in self.rewards.poll():
            if not self.eval_schedule.take(res.request_id, res.reward, self.version):
                self.schedule.graded(res, self.groups.pending[res.request_id])
                self.groups.add(res)

    def _drained(self) -> bool:
        return self.tickets.exhausted and sampling_idle(self.loop, self.episodes) and not self.groups.pending

    def _send(self) -> None:
        if self.tickets.report_due(bool(self.groups.ready), self._drained()):
            self.transport.send("learner", Rollouts(self.cfg.index, self.groups.take_ready(), self.stats()))

    # ----- reporting -----

    def describe(self) -> str:
        """One line of state, for the stall warning."""
        t, g = self.tickets, self.groups
        return (
            f"{self.endpoint}: version {self.version}, {self.loop.num_live} live / "
            f"{self.loop.free_slots} free slots, {t.queued(self.loop.stats.requests_admitted)} prompts "
            f"queued, {t.asked} asked, {len(g.pending)} rewards pending, {len(g.partial)} partial groups, "
            f"{g.groups_sent} groups sent"
            + (", data exhausted" if t.exhausted else "")
            + (f", {self.episodes.in_flight} episodes in flight" if self.episodes is not None else "")
        )

    def stats(self, final: bool = False) -> ActorStats:
        """Counters since the start (the learner lead logs them); `final` adds the reward service's."""
        s, ev, now = self.loop.stats, self.eval_schedule, time.perf_counter()
        return ActorStats(
            version=self.version,
            sample_tokens=self.groups.sample_tokens,
            completions=s.completions,
            occupancy=float(s.occupancy),
            idle_s=self.idle.idle_s(now),
            weight_s=self.arrivals.seconds,
            eval_s=ev.seconds,
            eval_spans=list(ev.spans),
            evals_skipped=list(ev.skipped),
            sample_calls_during_eval=ev.sample_calls_during,
            reward_errors=int(sum(self.rewards.stats()["errors"].values())),
            drained=self._drained(),
            checksums=dict(self.arrivals.checksums),
            reward_stats=self.rewards.stats() if final else None,
            wall_s=self.idle.wall_s(now),
            env=None if self.episodes is None else self.episodes.stats(),
        )

    def _final_stats(self) -> ActorStats:
        final = self.stats(final=True)
        final.weight_bytes = self.arrivals.bytes_report()
        if self.members is not None:  # a replica that spans processes: what each member did
            pulled = int(getattr(self.arrivals.weights, "last_bytes", 0))
            final.replica = self.members.report(self.loop.stats.tokens_generated, pulled)
        if self.executables is not None:
            final.executables = self.executables.report()
        return final
