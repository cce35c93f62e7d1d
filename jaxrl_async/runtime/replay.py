"""Replay: runs a recorded asynchronous run again in one process, following its schedule log
(runtime/schedule_log.py) instead of the clock (`jaxrl-run --config=... --replay=WORKDIR`).

It walks each actor's recorded decode calls in order, causally. Before call i it trains the learner up to
each version the record applied there (every group of those steps was complete in the run by then, so it
is complete in the replay too), applies it with the recorded update mode, queues the recorded requests
(the same group ids, so the same sampling streams), and runs the call. Each completion gets the reward
result the run recorded for it, and its tokens are checked against the run's CRC. Each version's
parameters are fingerprinted and compared with the run's: the report names the first version that
differs, and the first completion whose tokens differ.

Multi-turn episodes (config.env) are replayed with the environments' recorded answers, each applied
after the decode call the run applied it after (runtime/replay_episodes.py): no tool runs, and each model
turn is checked against the run's CRC before its answer is applied. Several actors (sampler replicas)
are replayed side by side, each with an engine of its own (`Replay._walk`).

With the same machine kind, software and config the replay produces the same parameters, bit for bit, at
every version (the engine is built with the kernels the run's timing chose, recorded in the actor's
start record). What it covers: one segment of the record (a process start: the run's, or a resume from
a checkpoint, `--replay_from`), no controlled lag.
docs/reproducibility.md.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import zlib
from typing import Any

import numpy as np

from jaxrl_async import storage
from jaxrl_async.data import prompt_at
from jaxrl_async.data.length_caps import length_cap_fn
from jaxrl_async.rewards.service import RewardResult
from jaxrl_async.run_config import ConfigError, RunConfig, validate
from jaxrl_async.runtime.build import (
    build_engines,
    build_tokenizer,
    initial_params,
    model_config,
    sampler_config,
    sampler_mesh,
    single_process,
    train_state,
    trainer_mesh,
    warm_started_params,
)
from jaxrl_async.runtime.checkpoint import RunCheckpoints
from jaxrl_async.runtime.learner import TrainerCore
from jaxrl_async.runtime.messages import Tickets
from jaxrl_async.runtime.replay_episodes import AnswerMissing, ReplayEpisodes
from jaxrl_async.runtime.rollout_groups import GroupAssembly
from jaxrl_async.runtime.schedule_log import fingerprint, read_schedule, schedule_path
from jaxrl_async.runtime.tickets import TicketBook
from jaxrl_async.runtime.weight_sync import LocalWeights, WeightSync, sampler_dtype
from jaxrl_async.sampler import SamplerLoop

log = logging.getLogger(__name__)


class ScheduleBroken(Exception):
    """The replay cannot follow the record any further (its rollouts differ from the run's)."""


def segments(records: list[dict]) -> list[list[dict]]:
    """The records of each process start (from one {"start": ...} to the next): more than one when the
    run was resumed."""
    starts = [i for i, r in enumerate(records) if "start" in r]
    if not starts:
        raise ConfigError("schedule record without a start record")
    return [records[a:b] for a, b in zip(starts, [*starts[1:], len(records)], strict=True)]


class RecordedRewards:
    """The reward service of a replay: each completion gets the result the run recorded for it (per
    (group, sample), in order: a group started again after a drop is graded again). Grades nothing."""

    def __init__(self, records: list[dict]):
        self._recorded: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        for r in records:
            for gid, sample, *rest in r["r"]:
                self._recorded[(gid, sample)].append(rest)  # [reward, CRC(, reason)]
        self._taken: dict[tuple, list] = {}
        self._ready: list[RewardResult] = []

    def check(self, completion) -> bool | None:
        """Takes the recorded result of `completion`; whether its tokens are the run's, or None when the
        run graded no such completion (it stopped first): it is then not to be submitted."""
        key = (int(completion.uid), int(completion.sample_index))
        if not self._recorded.get(key):
            return None
        rec = self._recorded[key].popleft()
        self._taken[key] = rec
        return zlib.crc32(np.asarray(completion.tokens, np.int32).tobytes()) == rec[1]

    def submit(self, key, prompt, completion, metadata) -> None:
        reward, _, *reason = self._taken.pop(key)
        self._ready.append(RewardResult(key, reward, reason[0] if reason else "ok", 0.0))

    def poll(self) -> list[RewardResult]:
        ready, self._ready = self._ready, []
        return ready

    def stats(self) -> dict:
        return {"errors": {}}


@dataclasses.dataclass
class _Actor:
    """One recorded actor in a replay: its events and the sampler that follows them."""

    index: int
    records: dataclasses.InitVar[list[dict]]  # its records of the replayed segment (a start record first)
    events: list[dict] = dataclasses.field(init=False)  # its decode calls and environments' answers, in order
    kernels: dict = dataclasses.field(init=False)  # the decode kernels its engine had
    loop: Any = None  # its SamplerLoop (`Replay._build`)
    episodes: Any = None  # its ReplayEpisodes (multi-turn runs)
    pos: int = 0  # events replayed
    version: int | None = None  # the version it applied last

    def __post_init__(self, records):
        self.events = [r for r in records if "c" in r or "o" in r]
        self.kernels = {k: records[0][k] for k in ("attention", "linear")}


@dataclasses.dataclass
class Report:
    """What a replay found (written as WORKDIR/replay/report.json)."""

    versions: dict[int, dict] = dataclasses.field(default_factory=dict)  # version -> run's / replay's fp
    first_divergent_version: int | None = None
    first_differing_completion: dict | None = None  # {"call", "group", "sample"}
    schedule_broken: str | None = None
    calls: int = 0  # decode calls replayed
    steps: int = 0  # train steps replayed
    restarts: int = 0  # process starts after the first in the record (each a segment of its own)

    @property
    def identical(self) -> bool:
        return self.first_divergent_version is None and self.schedule_broken is None and bool(self.versions)

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "identical": self.identical}


class Replay:
    """One replay (see the module docstring).

    Args:
      config: the run's config (the same file and overrides; a changed field is how a user tests a
        change, e.g. another learning rate: the report says where the parameters part).
      recorded: the recorded run's workdir (its schedule/ is read).
      to_version: stop after training this version (None: the whole segment).
      from_version: replay the segment of the process start at this version: 0, the run's start, or a
        version the run was resumed at, whose checkpoint (in the recorded workdir) is restored. A resumed
        process starts its sampler afresh (the prompts in flight are started again), so a segment's
        replay from its checkpoint is exact; a checkpoint in mid-segment is not a place to start (the
        sampler's state there, sequences decoded by older versions, is in no checkpoint).
    """

    def __init__(self, config, recorded: str, to_version: int | None = None, from_version: int = 0):
        self.run: RunConfig = validate(config, num_devices=None)
        self.recorded, self.to_version, self.from_version = recorded, to_version, from_version
        if self.run.trainer.controlled_lag:
            raise ConfigError("replay: config.trainer.controlled_lag is not replayed")
        names = {p.name for p in storage.path(storage.join(recorded, "schedule")).glob("actor-*.jsonl")}
        if not names or names != {f"actor-{i}.jsonl" for i in range(len(names))}:
            raise ConfigError(f"replay: {recorded}/schedule holds actors' records {sorted(names)}, not "
                              "actor-0.jsonl to actor-<n-1>.jsonl")  # fmt: skip
        self.report = Report()
        learner_segs = segments(read_schedule(schedule_path(recorded, "learner")).records)
        actor_segs = [segments(read_schedule(schedule_path(recorded, f"actor:{i}")).records)
                      for i in range(len(names))]  # fmt: skip
        starts = [s[0]["version"] for s in learner_segs]
        if from_version not in starts or any(len(a) != len(learner_segs) for a in actor_segs):
            counts = [len(a) for a in actor_segs]
            raise ConfigError(f"replay: --replay_from={from_version}: the learner's record starts at "
                              f"versions {starts} (the actors' records start {counts} times)")  # fmt: skip
        i = starts.index(from_version)
        self.report.restarts = len(starts) - 1
        learner_recs = learner_segs[i]
        self.start, self.steps = learner_recs[0], collections.deque(learner_recs[1:])
        self.actors = [_Actor(n, a[i]) for n, a in enumerate(actor_segs)]
        self.rewards = RecordedRewards([r for a in actor_segs for r in a[i] if "r" in r])

    # ----- building -----

    def _build(self) -> None:
        run, cluster = self.run, single_process()
        tokenizer = build_tokenizer(run)
        model_cfg = model_config(run, tokenizer)
        s_mesh, t_mesh = sampler_mesh(run, cluster), trainer_mesh(run, cluster)
        for a in self.actors:  # each with the kernels its run's timing chose
            engine = build_engines(run, model_cfg, s_mesh, dataclasses.replace(sampler_config(run, tokenizer),
                                                                               **a.kernels))[0]  # fmt: skip
            a.loop = SamplerLoop(engine)
            a.episodes = ReplayEpisodes(run.env, a.loop, tokenizer) if run.env.enabled else None
        if run.warm_start.enabled and not self.from_version:
            device = t_mesh.devices.flat[0]
            params = warm_started_params(run, model_cfg, tokenizer, device, show=False)[0]
        else:  # (a checkpoint's state replaces these; the KL reference, if any, is the starting policy)
            params = initial_params(run, model_cfg, t_mesh)
        state = train_state(run, model_cfg, t_mesh, params)
        if self.from_version:
            ckpts = RunCheckpoints(storage.join(self.recorded, "checkpoints"))
            state = ckpts.restore(state, self.from_version)[0]
            ckpts.close()
        publisher = LocalWeights(WeightSync(model_cfg, s_mesh, dtype=sampler_dtype(model_cfg)))
        self.core = TrainerCore(state, run.trainer, publisher, None)
        caps = length_cap_fn(run.length_caps) if run.length_caps else None
        # (a grant's requests do not depend on the actor: one book serves them all)
        self.tickets = TicketBook(0, run.seed, run.schedule, engine.cfg.num_slots, len(self.actors), caps)
        self.groups = GroupAssembly(run.schedule.samples_per_prompt, run.reward, engine.cfg.max_new_tokens,
                                    self.rewards, tokenizer)  # fmt: skip
        self.prompt = functools.partial(prompt_at, run.data, tokenizer)
        self.ready: dict[int, list] = {}  # group id -> its latest complete group
        self.published: dict[int, Any] = {}  # version -> params on the sampler's devices

    # ----- the walk -----

    def __call__(self) -> Report:
        self._build()
        self._check(self.core.version, self.start["fp"])
        self.published[self.core.version] = self.core.publish().params
        try:
            self._walk()
            self._train_to(None)  # the steps left (none once the walk stopped early: it ran out of them)
        except ScheduleBroken as e:
            self.report.schedule_broken = str(e)
            log.warning("replay stops: %s", e)
        finally:
            for a in self.actors:
                if a.episodes is not None:
                    a.episodes.close()
        return self.report

    def _walk(self) -> None:
        """Each actor's events in its own order; between actors, any order that the run's causality
        allows: an actor goes on once the versions its next call applies can be trained (their groups are
        complete here). Which allowed order is taken changes nothing: every actor's state depends only on
        its own events and the versions it applies, and a step only on its recorded groups."""
        while True:
            waiting = [a for a in self.actors if a.pos < len(a.events)]
            if not waiting:
                return
            # None runnable: the first is run, and `_train_to` names the groups that are missing.
            actor = next((a for a in waiting if self._runnable(a.events[a.pos])), waiting[0])
            rec = actor.events[actor.pos]
            actor.pos += 1
            if not (self._call(actor, rec) if "c" in rec else self._answers(actor, rec)):
                return

    def _runnable(self, rec: dict) -> bool:
        """Whether the versions that call `rec` applies are trained, or can be with the groups at hand."""
        want = max((v for v, _, _ in rec.get("apply", ())), default=self.core.version)
        need = set()
        for step in self.steps:
            if step["t"] > want:
                break
            need.update(step["g"])
        return need <= self.ready.keys()

    def _done(self) -> bool:
        return self.to_version is not None and self.core.version >= self.to_version

    def _call(self, actor: _Actor, rec: dict) -> bool:
        """Replays one recorded decode call; False once the replay is over (every recorded step, or up to
        `to_version`, trained: what the actor decoded after that never reached the learner)."""
        if not self.steps:
            return False
        for version, mode, _live in rec.get("apply", ()):
            self._train_to(version)
            if self._done():
                return False
            actor.loop.update_params(self.published[version], version, mode)
            actor.version = version
            # Each actor applies versions oldest first: one older than every actor's last is not needed.
            oldest = min(-1 if a.version is None else a.version for a in self.actors)
            for old in [v for v in self.published if v < oldest]:
                del self.published[old]
        for gid, key in rec.get("add", ()):
            for request in self.tickets.grant(Tickets([(gid, self.prompt(key))], False)):
                (actor.loop if actor.episodes is None else actor.episodes).add_request(request)
        self.report.calls += 1
        if actor.episodes is not None:  # turns that end park; episodes end with the recorded answers
            actor.episodes.step()
            return True
        completions = actor.loop.step(lambda: None)
        at = (actor.index, rec["c"])
        self._assemble([c for c in completions if self._graded_as_in_the_run(at, c)], [])
        return True

    def _answers(self, actor: _Actor, rec: dict) -> bool:
        """Applies the environments' answers recorded after call rec["at"] (multi-turn episodes)."""
        if not self.steps:
            return False
        at = (actor.index, rec["at"])
        try:
            ended, differ = actor.episodes.answers(rec["o"])
        except AnswerMissing as e:
            self._differs(at, *e.args[1])
            raise ScheduleBroken(f"actor {at[0]}, after call {at[1]}: {e.args[0]}") from None
        for key in differ:
            self._differs(at, *key)
        answered = [e for e in ended if e[0].finish_reason == "answer"]  # graded by the reward service
        graded = [e for e in answered if self._graded_as_in_the_run(at, e[0])]
        self._assemble([], graded + [e for e in ended if e[0].finish_reason != "answer"])
        return True

    def _graded_as_in_the_run(self, at: tuple[int, int], sample) -> bool:
        """Takes the run's reward result of `sample` (a completion or an episode); False when the run
        graded no such sample (it stopped first: the sample forms no group, as it formed none there)."""
        same = self.rewards.check(sample)
        if same is False:
            self._differs(at, int(sample.uid), int(sample.sample_index))
        return same is not None

    def _differs(self, at: tuple[int, int], group: int, sample: int) -> None:
        """Notes the first sample whose tokens differ from the run's (`at`: the actor and its call)."""
        if self.report.first_differing_completion is None:
            self.report.first_differing_completion = {"actor": at[0], "call": at[1], "group": group,
                                                      "sample": sample}  # fmt: skip

    def _assemble(self, completions: list, episodes: list) -> None:
        """Grades (with the recorded results) and groups finished samples, as the run's actor did."""
        self.groups.submit(completions)
        self.groups.submit_episodes(episodes)
        for res in self.rewards.poll():
            self.groups.add(res)
        for g in self.groups.take_ready():
            self.ready[int(g[0].group_id)] = g

    def _train_to(self, version: int | None) -> None:
        """Trains the recorded steps up to `version` (None: every one left, or up to `to_version`)."""
        while self.steps and (version is None or self.core.version < version) and not self._done():
            rec = self.steps.popleft()
            missing = [g for g in rec["g"] if g not in self.ready]
            if missing:
                raise ScheduleBroken(f"version {rec['t']}: groups {missing} are not complete where the run "
                                     f"had trained them (its rollouts differ from the run's)")  # fmt: skip
            self.core.dispatch([self.ready.pop(g) for g in rec["g"]])
            self.report.steps += 1
            if self.core.version != rec["t"]:
                raise ScheduleBroken(
                    f"the step recorded as version {rec['t']} gave version {self.core.version}"
                )
            self._check(rec["t"], rec["fp"])
            self.published[rec["t"]] = self.core.publish().params

    def _check(self, version: int, recorded_fp: int | None) -> None:
        mine = fingerprint(self.core.state.params)
        self.report.versions[version] = {"run": recorded_fp, "replay": mine}
        if recorded_fp is not None and mine != recorded_fp and self.report.first_divergent_version is None:
            self.report.first_divergent_version = version
            log.warning("replay: version %d differs from the run's (fingerprint %d, the run's %d)", version,
                        mine, recorded_fp)  # fmt: skip


def replay_run(config, recorded: str, to_version: int | None = None, from_version: int = 0) -> dict[str, Any]:
    """Replays the run recorded in `recorded` (see `Replay`); returns the report, also written to
    <recorded>/replay/report.json."""
    report = Replay(config, recorded, to_version, from_version)().as_dict()
    out = storage.join(recorded, "replay")
    storage.makedirs(out)
    storage.write_text(storage.join(out, "report.json"), json.dumps(report, indent=2))
    return report
