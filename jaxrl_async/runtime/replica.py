"""Sampler replicas whose mesh spans several processes (one per host): the leader and its members.

A replica's programs (prefill, insert, generate, recompute, the weight layout, the checksum) are SPMD over
its whole mesh: every member must enter each of them, in the same order, with the same host inputs, or the
others wait forever. The *leader* (the replica's first process) is the actor: it talks to the coordinator
and the learner (admission, weight versions, rollouts out) and, before it runs anything on the mesh, tells
the other members to run the same. A member replays the commands on its own `SamplerLoop` (and its own
`Evaluation`) over engines of the same mesh. The loop is deterministic given its requests and weight
updates, so every member makes the same engine calls, slot assignments and reads; the engine gathers
each round's tokens onto every device (`sampler.spec.spans_processes`), so the reads need no computation
of their own. A member discards its completions: rollouts leave the replica once, from the leader.

The commands (`runtime.messages`): one `MemberStep` per loop step (the requests queued since the last one,
and whether the evaluation in progress takes its generate call), one `MemberReceive` per published
version (the member pulls its own devices' pieces), one `MemberApply` per version swapped in (with the
update mode: keep_kv, recompute_kv and finish act on every member at the same loop step), one
`MemberEvaluate` per evaluation started, and `Stop`. Multi-turn episodes (config.env) add the calls the
episode driver makes between loop steps, each told before the leader makes it (`MirroredLoop`): a
`MemberResume` per observation appended to a parked turn (`SamplerLoop.resume`, which runs
`Engine.extend` on the mesh), a `MemberFinish` per episode ended, and for the greedy episodes of an
evaluation `MemberEvalRequest` (their requests) and `MemberEvalStep` (each of its loop steps, told apart
from `MemberStep`: the sampling loop's resumes come between the two generate calls). They travel over a
`ZmqTransport` star around the leader (the hub's wire format: codec, HMAC, run id), directly, not through
the learner lead: a decode call must not wait for the lead's event loop. docs/distributed.md gives the
bytes per call.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from jaxrl_async.runtime.cluster import Cluster, PeerFailure
from jaxrl_async.runtime.evaluation import Evaluation
from jaxrl_async.runtime.messages import (
    Hello,
    MemberApply,
    MemberEvalRequest,
    MemberEvalStep,
    MemberEvaluate,
    MemberFinish,
    MemberPing,
    MemberReceive,
    MemberReport,
    MemberRequest,
    MemberResume,
    MemberStep,
    NewWeights,
    Stop,
)
from jaxrl_async.runtime.transport import ZmqTransport
from jaxrl_async.runtime.weight_sync import checksum
from jaxrl_async.sampler import Request, SamplerLoop

log = logging.getLogger(__name__)

LEADER = "replica"  # the leader's endpoint on its replica's channel


def as_member_request(r: Request) -> MemberRequest:
    """What a member needs of a request the leader queued."""
    tokens = np.asarray(r.prompt_tokens, np.int32)
    return MemberRequest(int(r.uid), tokens, int(r.n_samples), int(r.seed), r.max_new_tokens, bool(r.park))


def as_request(r: MemberRequest) -> Request:
    """The member's loop's request for what the leader queued."""
    tokens = tuple(int(t) for t in r.prompt_tokens)
    return Request(r.uid, tokens, r.n_samples, r.seed, r.max_new_tokens, park=r.park)


# ----- the leader's side -------------------------------------------------------------------------------


class Members:
    """The leader's channel to the other members of its replica (they connect to it).

    Args:
      cluster: the leader's place in the run.
      replica: the replica's index.
      members: the other members' process ids, in mesh order.
      key: the run's secret (`secret.load()`, which takes it out of the environment: load it once).
      timeout_s: how long to wait for every member to connect.
    """

    def __init__(self, cluster: Cluster, replica: int, members: tuple[int, ...], key: bytes,
                 timeout_s: float = 600.0):  # fmt: skip
        self.cluster, self.replica, self.pids = cluster, replica, tuple(members)
        self.channel = ZmqTransport([LEADER], True, cluster.host, cluster.process_id, key)
        for p in self.pids:
            self.channel.route(f"member:{p}", p)
        cluster.publish(f"replica/{replica}", self.channel.address)
        self.messages = self.calls = 0
        self.reports: dict[int, MemberReport] = {}
        self._queued: list[MemberRequest] = []  # requests queued since the members' last step
        self.applied_at: dict[int, int] = {}  # version -> the leader's decode steps run before it
        want, deadline = set(self.pids), time.monotonic() + timeout_s
        while want:  # the hub can address a member only once it has said hello
            want -= {m.process_id for m in self.channel.recv(LEADER) if isinstance(m, Hello)}
            cluster.check_peers()
            if time.monotonic() > deadline:
                raise PeerFailure(f"replica {replica}: member process(es) {sorted(want)} never connected")
            self.channel.wait(0.05)

    def tell(self, command) -> None:
        """Sends `command` to every member (before the leader runs it: they must enter the same programs)."""
        for p in self.pids:
            self.channel.send(f"member:{p}", command)
        self.messages += len(self.pids)

    def queue(self, request: Request) -> None:
        """A request the leader queued: it goes to the members with their next step."""
        self._queued.append(as_member_request(request))

    def step(self, evaluate: bool) -> None:
        """The members run this loop step with the leader (and the evaluation's call, if `evaluate`)."""
        self.tell(MemberStep(self.calls, self._queued, evaluate))
        self._queued = []
        self.calls += 1

    def applied(self, version: int, decode_steps: int) -> None:
        """The leader swapped in `version` after `decode_steps` decode steps (the final report's)."""
        self.applied_at[version] = decode_steps

    def explain(self, error: Exception, timeout_s: float = 3.0) -> Exception:
        """What to raise for `error`, raised while the leader ran the replica's programs: a PeerFailure
        naming the members whose connection is gone (a member that died breaks the collective the leader
        waits in, whose own error names only a socket), else `error` itself."""
        deadline = time.monotonic() + timeout_s
        while True:
            dead = []
            for p in self.pids:
                try:
                    self.channel.send(f"member:{p}", MemberPing())
                except PeerFailure:
                    dead.append(p)
            if dead:
                names = ", ".join(f"process {p} ({self.cluster.roles.role(p)})" for p in dead)
                return PeerFailure(f"{names} stopped: the replica's computation failed ({error})")
            if time.monotonic() > deadline:
                return error
            time.sleep(0.1)

    def stop(self, timeout_s: float = 60.0) -> dict:
        """Stops the members and collects their reports (member pid -> MemberReport fields)."""
        self.tell(Stop())
        deadline = time.monotonic() + timeout_s
        while len(self.reports) < len(self.pids) and time.monotonic() < deadline:
            for m in self.channel.recv(LEADER):
                if isinstance(m, MemberReport):
                    self.reports[m.process_id] = m
            self.cluster.check_peers()
            self.channel.wait(0.05)
        missing = sorted(set(self.pids) - set(self.reports))
        if missing:
            log.warning("replica %d: no report from member process(es) %s within %.0f s", self.replica,
                        missing, timeout_s)  # fmt: skip
        return {p: dataclasses.asdict(r) for p, r in self.reports.items()}

    def report(self, tokens_generated: int, pulled_bytes: int) -> dict:
        """The replica's part of the leader's final report: when it applied each version, the tokens it
        decoded and the weight bytes it pulled, and each member's own report (this stops the members)."""
        return {"applied_at": dict(self.applied_at), "tokens_generated": tokens_generated,
                "pulled_bytes": pulled_bytes, "members": self.stop()}  # fmt: skip

    def close(self) -> None:
        self.channel.close()


class MirroredLoop:
    """The leader's loop as a multi-turn episode driver (`envs.driver.EpisodeDriver`) sees it: the calls
    that change what the loop runs are told to the members first, so that they make them at the same
    point between the same programs. The sampling loop's requests go with the next `MemberStep` (as
    the actor's do); an evaluation's (`evaluation`) are told at once, and each of its steps too.

    Args:
      loop: the leader's SamplerLoop (everything else is read from it as it is).
      members: the replica's `Members`.
      evaluation: this is the running evaluation's loop, not the sampling loop.
    """

    def __init__(self, loop: SamplerLoop, members: Members, evaluation: bool):
        self._loop, self._members, self._evaluation = loop, members, evaluation

    def __getattr__(self, name):
        return getattr(self._loop, name)

    def add_request(self, request: Request) -> None:
        if self._evaluation:
            self._members.tell(MemberEvalRequest(as_member_request(request)))
        else:
            self._members.queue(request)
        self._loop.add_request(request)

    def resume(self, uid, sample_index: int, observation, max_new_tokens: int | None = None) -> None:
        obs, limit = np.asarray(observation, np.int32).reshape(-1), max_new_tokens or 0
        self._members.tell(MemberResume(self._evaluation, int(uid), int(sample_index), obs, limit))
        self._loop.resume(uid, sample_index, observation, max_new_tokens)

    def finish(self, uid, sample_index: int) -> None:
        self._members.tell(MemberFinish(self._evaluation, int(uid), int(sample_index)))
        self._loop.finish(uid, sample_index)

    def step(self, admit=None) -> list:
        if self._evaluation:
            self._members.tell(MemberEvalStep())
        return self._loop.step(admit)


# ----- a member's side ---------------------------------------------------------------------------------


class ReplicaMember:
    """A replica member other than the leader: replays the leader's commands (see the module docstring).

    Args:
      cluster: this process's place in the run.
      replica: the replica's index (its leader is `cluster.roles.replicas[replica][0]`).
      engine, eval_engine: the sampling and greedy engines on the replica's mesh (as the leader's).
      eval_prompts: the held-out prompts (replica 0 evaluates), as the leader has them.
      weights: this member's receiver (`TransferReceiver`, or a LoRA run's `lora_sync.LoraReceiver`: the
        base once, then the adapters, each checked against the leader's `MemberReceive.checksum`).
      verify: checksum every received version (config.verify_weights; the leader does the same).
      key: the run's secret (`secret.load()`, which takes it out of the environment: load it once).
      episodes: multi-turn episodes (config.env.enabled): an evaluation's requests come from the leader
        (`MemberEvalRequest`), not from `eval_prompts`.
    """

    def __init__(self, cluster: Cluster, replica: int, engine, eval_engine, eval_prompts, weights,
                 verify: bool, key: bytes, episodes: bool = False):  # fmt: skip
        self.cluster, self.replica, self.pid = cluster, replica, cluster.process_id
        self.engine, self.eval_engine, self.eval_prompts = engine, eval_engine, eval_prompts
        self.weights, self.verify, self.episodes = weights, verify, episodes
        self.endpoint = f"member:{self.pid}"
        address = cluster.lookup(f"replica/{replica}")
        self.channel = ZmqTransport([self.endpoint], False, address, self.pid, key)
        self.channel.send(LEADER, Hello(self.pid))
        self.loop = SamplerLoop(engine)
        self.received: tuple[int, dict] | None = None
        self.held: dict[int, dict] = {}  # version -> weights kept for an evaluation to come
        self.evaluation: Evaluation | None = None
        self._steps = 0  # loop steps run (the leader numbers its MemberSteps the same way)
        self.applied_at: dict[int, int] = {}
        self.checksums: dict[int, float] = {}
        self.done = False

    def poll(self) -> bool:
        """Runs every command that has arrived, in order; False if none had."""
        commands = self.channel.recv(self.endpoint)
        for c in commands:
            self._run(c)
            if self.done:
                break
        return bool(commands)

    def wait(self, timeout_s: float) -> None:
        self.channel.wait(timeout_s)

    def _run(self, c) -> None:
        if isinstance(c, MemberStep):
            self._step(c)
        elif isinstance(c, MemberReceive):
            params = self.weights.receive(NewWeights(c.version, None, c.checksum))
            if self.verify:
                # A LoRA receiver checked the adapters against the sent sum (what the leader's does, the
                # same SPMD program); a full version's whole tree is summed here, as on the leader.
                got = getattr(self.weights, "checked", {}).pop(c.version, None)
                self.checksums[c.version] = checksum(params) if got is None else got
            self.received = (c.version, params)
            if c.hold:
                self.held[c.version] = params
        elif isinstance(c, MemberApply):
            if self.received is None or self.received[0] != c.version:
                have = None if self.received is None else self.received[0]
                raise RuntimeError(f"{self.endpoint}: told to apply version {c.version}, received {have}")
            self.loop.update_params(self.received[1], c.version, c.mode)
            self.applied_at[c.version] = self.loop.stats.decode_steps
        elif isinstance(c, MemberEvaluate):
            params = self.held.pop(c.version) if c.own_weights else None
            prompts = [] if self.episodes else self.eval_prompts
            self.evaluation = Evaluation(self.eval_engine, None, None, prompts, params, c.version)
        elif isinstance(c, (MemberResume, MemberFinish, MemberEvalRequest, MemberEvalStep)):
            self._episode_call(c)
        elif isinstance(c, MemberPing):
            pass
        elif isinstance(c, Stop):
            self.done = True
            s, pulled = self.loop.stats, int(getattr(self.weights, "last_bytes", 0))
            report = MemberReport(self.pid, self._steps, s.tokens_generated, dict(self.applied_at),
                                  dict(self.checksums), pulled)  # fmt: skip
            self.channel.send(LEADER, report)
        else:
            raise TypeError(f"{self.endpoint}: unexpected command {type(c).__name__}")

    def _step(self, c: MemberStep) -> None:
        if c.call != self._steps:  # commands arrive in order over one connection; this is a guard
            raise RuntimeError(f"{self.endpoint}: the leader's step {c.call}, this member's {self._steps}")
        for r in c.requests:
            self.loop.add_request(as_request(r))
        self.loop.step(_none)
        self._steps += 1
        if c.evaluate:
            if self.evaluation is None:
                raise RuntimeError(f"{self.endpoint}: told to evaluate at step {c.call}, none started")
            self.evaluation.decode()

    def _episode_call(self, c) -> None:
        """A multi-turn episode driver's call on the leader's loop (`MirroredLoop`), made here on the same."""
        if isinstance(c, MemberEvalStep | MemberEvalRequest) or c.evaluation:
            if self.evaluation is None:
                raise RuntimeError(f"{self.endpoint}: told {type(c).__name__} with no evaluation started")
            loop = self.evaluation.loop
        else:
            loop = self.loop
        if isinstance(c, MemberEvalStep):
            loop.step(_none)
        elif isinstance(c, MemberEvalRequest):
            loop.add_request(as_request(c.request))
        elif isinstance(c, MemberFinish):
            loop.finish(c.uid, c.sample_index)
        else:
            try:
                loop.resume(c.uid, c.sample_index, c.observation, c.max_new_tokens or None)
            except ValueError:  # the leader's resume refused the same (capacity): it finishes the turn next
                pass

    def describe(self) -> str:
        return (
            f"{self.endpoint} (replica {self.replica} member): {self._steps} loop steps, "
            f"{self.loop.num_live} live slots, version {self.engine.version}"
        )

    def close(self) -> None:
        self.channel.close()


def _none():
    return None  # every request is queued from a MemberStep (the leader steps its loop without admit)
