"""The messages between the roles of a run (what `jaxrl_async.runtime.transport` carries).

Every message is a dataclass of plain data: ints, floats, strings, lists and dicts of them, numpy
arrays, and the library records `Rollout` and `Prompt`. In one process they travel as objects; between
processes `jaxrl_async.runtime.codec` encodes them against the schema it keeps for each of them, and
decodes nothing else.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Hello:
    """A non-lead process announcing itself to the hub (lets the ROUTER address it)."""

    process_id: int


@dataclasses.dataclass
class TicketRequest:
    """An actor asks the coordinator for up to `n` more prompts to start."""

    actor: int
    n: int


@dataclasses.dataclass
class Tickets:
    """Prompts the actor may start: (group id, Prompt) pairs; `exhausted` when the data has ended."""

    prompts: list
    exhausted: bool = False


@dataclasses.dataclass
class ActorStats:
    """An actor's counters since its start: sent with every `Rollouts`, and in its `Stopped` with the
    reward service's counters."""

    version: int | None  # the policy version it samples with (None before the first)
    sample_tokens: int  # completion tokens sampled
    completions: int
    occupancy: float  # fraction of slot-steps that produced a token
    idle_s: float  # wall time with nothing to decode or grade
    weight_s: float  # time spent receiving weights
    eval_s: float  # wall time of the finished evaluations
    eval_spans: list  # (version, start, end) of each finished evaluation, time.monotonic
    evals_skipped: list  # versions due but not evaluated (config.eval_weights="shared")
    sample_calls_during_eval: int  # sampling generate calls made while an evaluation was running
    reward_errors: int  # completions the reward service scored 0 because grading failed
    drained: bool  # the data is exhausted and nothing is in flight
    checksums: dict  # version -> weight checksum (config.verify_weights)
    reward_stats: dict | None = None  # the reward service's counters (in `Stopped` only)
    # A replica that spans processes (in `Stopped` only): when each member applied each version, the
    # tokens decoded, the bytes pulled, and each member's report.
    replica: dict | None = None
    # What this sampler process's executable store did (in `Stopped` only; a process other than 0 with
    # config.compile_cache_dir): programs loaded, compiled, kept.
    executables: dict | None = None
    # Seconds since the actor started, on its own clock, when these counters were read: idle_s grows by
    # at most as much, so the learner takes the idle fraction per second of this clock, not of its own
    # (a report may come long after the idle time it carries: the actor sends none while it is idle).
    wall_s: float = 0.0
    # Multi-turn runs (config.env): running counters of episodes and tool calls since the start
    # (`episodes.EpisodeRunner.stats`; the learner logs them as env/ tags), None for single-turn runs.
    env: dict | None = None
    # What the weights brought to this sampler process (in `Stopped` only; `Arrivals.bytes_report`).
    weight_bytes: dict | None = None

    @classmethod
    def empty(cls) -> ActorStats:
        """An actor's counters before it has done anything."""
        return cls(None, 0, 0, 0.0, 0.0, 0.0, 0.0, [], [], 0, 0, False, {})


@dataclasses.dataclass
class Rollouts:
    """Finished, graded groups from an actor, with its counters."""

    actor: int
    groups: list
    stats: ActorStats


@dataclasses.dataclass
class NewWeights:
    """Policy `version` is published: `params` in the sampler layout (one process) or None (pull them)."""

    version: int
    params: Any = None
    checksum: float | None = None


@dataclasses.dataclass
class EvalResult:
    """Greedy held-out accuracy of policy `version`, measured by actor 0."""

    version: int
    accuracy: float
    seconds: float
    checksum: float | None = None
    expected_reward: float | None = None  # runtime/expected_reward.py, where the task allows it
    expected_reward_stderr: float | None = None


@dataclasses.dataclass
class TrainBatch:
    """The learner lead's instruction to every trainer process: train these groups into `version`."""

    version: int
    groups: list


@dataclasses.dataclass
class Trained:
    """The learner finished `version`: `group_ids` are the groups it trained, `dropped` the groups it
    discarded as too stale (the coordinator starts those again), `filtered` the groups dynamic sampling
    discarded as uninformative (done with; their admission budget returns)."""

    version: int
    group_ids: list
    dropped: list = dataclasses.field(default_factory=list)
    filtered: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SaveCheckpoint:
    """Every trainer process saves the train state of `version` (with the coordinator's state and the
    version's metrics); `wait` until it is written (the last one of a run)."""

    version: int
    coordinator_state: dict | None = None
    metrics: dict | None = None
    wait: bool = False


@dataclasses.dataclass
class Stop:
    """The run is over: stop and report."""


@dataclasses.dataclass
class Preempt:
    """A process was asked to stop (SIGTERM / SIGINT): the learner lead saves and stops the run."""

    process_id: int
    signal: str


@dataclasses.dataclass
class Stopped:
    """An actor's final counters after Stop."""

    actor: int
    stats: ActorStats


@dataclasses.dataclass
class WarmStartParams:
    """The learner lead's warm-started parameters for another trainer process (a pytree: nested dicts of
    arrays)."""

    params: Any


# ----- within a sampler replica that spans processes (runtime/replica.py): leader -> member, except
# MemberReport; `Hello` and `Stop` serve there too.


@dataclasses.dataclass
class MemberRequest:
    """A request the leader queued, as the member's loop must queue it (sampler.Request's fields that
    shape the decode: no metadata; `park`: a multi-turn episode's, whose turns park their slots)."""

    uid: int
    prompt_tokens: Any  # int32 [prompt_len]
    n_samples: int
    seed: int
    max_new_tokens: int | None
    park: bool = False


@dataclasses.dataclass
class MemberStep:
    """Run loop step `call` (counted from 0) after queueing `requests` (in the leader's order), then, with
    `evaluate`, one generate call of the evaluation in progress (`Evaluation.decode`)."""

    call: int
    requests: list
    evaluate: bool = False


@dataclasses.dataclass
class MemberResume:
    """Multi-turn episodes: `SamplerLoop.resume` of the parked turn (uid, sample_index) with `observation`
    (int32) and `max_new_tokens` (0: the loop's), on the member's sampling loop or, with `evaluation`, the
    running evaluation's. The leader tells it before it resumes (which runs `Engine.extend` on the mesh)."""

    evaluation: bool
    uid: int
    sample_index: int
    observation: Any  # int32 [observation_len]
    max_new_tokens: int


@dataclasses.dataclass
class MemberFinish:
    """Multi-turn episodes: `SamplerLoop.finish` of the parked turn (uid, sample_index) (its slot freed), on
    the sampling loop or, with `evaluation`, the running evaluation's."""

    evaluation: bool
    uid: int
    sample_index: int


@dataclasses.dataclass
class MemberEvalRequest:
    """Multi-turn evaluations: queue `request` (a MemberRequest) on the running evaluation's loop now (the
    leader's greedy episodes are queued when it starts, after its `MemberEvaluate`)."""

    request: Any


@dataclasses.dataclass
class MemberEvalStep:
    """Multi-turn evaluations: one step of the running evaluation's loop (with single-turn evaluations
    `MemberStep.evaluate` says this; with episodes the leader's sampling resumes come in between)."""


@dataclasses.dataclass
class MemberReceive:
    """Pull this member's pieces of policy `version` (every published version, as the leader does); `hold`
    them for an evaluation the leader will start later (its eval engine keeps weights of its own).
    `checksum`: the version's `NewWeights.checksum` (config.verify_weights), which a LoRA receiver checks
    the adapters it got against, as the leader's does (`lora_sync._Apply`)."""

    version: int
    hold: bool = False
    checksum: float | None = None


@dataclasses.dataclass
class MemberApply:
    """Swap in the last received version, `version`, with update `mode` (None: the first version)."""

    version: int
    mode: str | None = None


@dataclasses.dataclass
class MemberEvaluate:
    """Start an evaluation of `version` as the leader does: with the weights held for it
    (`own_weights`), or with the sampler's current ones (config.eval_weights='shared')."""

    version: int
    own_weights: bool


@dataclasses.dataclass
class MemberPing:
    """Nothing to run: the leader checks which members are still connected (after a failed computation)."""


@dataclasses.dataclass
class MemberReport:
    """A member's record after Stop: loop steps run, tokens its loop generated, the decode steps run before
    each version was applied, its weight checksums (with config.verify_weights), the bytes it pulled of
    the last version (its own devices' blocks)."""

    process_id: int
    steps: int
    tokens_generated: int
    applied_at: dict
    checksums: dict
    pulled_bytes: int = 0
