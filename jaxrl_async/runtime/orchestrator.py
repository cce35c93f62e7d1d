"""The orchestrator: the only module that knows every part. It builds the roles of this process and runs
their event loop.

Data flows one way: prompts (coordinator) -> actors (decode, grade) -> learner (train) -> weights ->
actors. A run is one program on every process; `jaxrl_async.runtime.cluster.Roles` says which roles
this process plays:

  one process          coordinator + learner + actor 0, in-memory transport, weights by device_put
  learner lead         coordinator + learner (+ the message hub, TensorBoard, checkpoint primary)
  other trainer        a follower running the lead's SPMD steps on its share of the trainer mesh
  sampler process      one actor over its own devices
  replica leader       one actor over a replica that spans processes: it tells the other members what to
                       run (jaxrl_async.runtime.replica)
  replica member       the leader's decode calls, replayed on its share of the replica's mesh

Every role is a `poll()` that never blocks on another role; the loop polls the roles of this process until
the learner lead says the run is over. `mode="sync"` is the same code with η = 0.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import threading
import time
from typing import Any

from jaxrl_async.data import held_out_prompts, make_prompt_iterator, prompt_at
from jaxrl_async.data.length_caps import length_cap_fn
from jaxrl_async.rewards import RewardService
from jaxrl_async.runtime import build, secret
from jaxrl_async.runtime.actor import Actor, ActorConfig
from jaxrl_async.runtime.cluster import Cluster, PeerFailure, Roles
from jaxrl_async.runtime.coordinator import Coordinator
from jaxrl_async.runtime.evaluation import trainer_idle_during
from jaxrl_async.runtime.lag import lagged
from jaxrl_async.runtime.learner import Follower, Learner, LearnerConfig, TrainerCore
from jaxrl_async.runtime.messages import Hello, Preempt, WarmStartParams
from jaxrl_async.runtime.metrics import MetricsWriter
from jaxrl_async.runtime.replica import Members, ReplicaMember
from jaxrl_async.runtime.transport import LocalTransport, ZmqTransport
from jaxrl_async.runtime.weight_sync import (
    LocalWeights,
    TransferPublisher,
    TransferReceiver,
    WeightSync,
    sampler_dtype,
)

log = logging.getLogger(__name__)

STALL_WARNING_S = 60.0  # log every role's state after this long without progress


def single_process() -> Cluster:
    """The cluster of a run without `jax.distributed`: one process, every role."""
    return Cluster(Roles(1, (0,), (0,)))


class _Process:
    """The roles of this process, built from the config, and what they hold that must be closed."""

    def __init__(self, run, cluster: Cluster):
        self.run, self.cluster = run, cluster
        self.roles: list = []
        self.closers: list = []
        self.learner: Learner | None = None
        self.coordinator: Coordinator | None = None
        self.actor: Actor | None = None
        self.follower: Follower | None = None
        self.key: bytes | None = None  # the run's secret (several processes)
        self.member: ReplicaMember | None = None
        self.warm_start_info = None
        self.reward_stats = None

    def close(self) -> None:
        for c in reversed(self.closers):
            try:
                c()
            except Exception:  # noqa: BLE001 - close everything else, then let the run's error surface
                log.exception("while closing")


def _transport(cluster: Cluster, key: bytes | None):
    roles, pid = cluster.roles, cluster.process_id
    if not roles.multi:
        return LocalTransport()
    if cluster.is_lead:
        t = ZmqTransport(["coordinator", "learner", "hello"], True, cluster.host, pid, key)
        for i, p in enumerate(roles.samplers):
            t.route(f"actor:{i}", p)
        for p in roles.trainers[1:]:
            t.route(f"trainer:{p}", p)
        for members in roles.replicas:
            for p in members[1:]:  # they say hello here, and may preempt; their commands come from the leader
                t.route(f"member:{p}", p)
        cluster.publish("hub", t.address)
        return t
    if pid in roles.samplers:
        local = [f"actor:{roles.samplers.index(pid)}"]
    elif pid in roles.trainers:
        local = [f"trainer:{pid}"]
    else:  # a replica member other than its leader
        local = [f"member:{pid}"]
    t = ZmqTransport(local, False, cluster.lookup("hub"), pid, key)
    t.send("hello", Hello(pid))
    return t


def _await_hellos(transport, cluster: Cluster, timeout_s: float = 600.0) -> None:
    """The hub waits until every other process has connected (only then can it address them)."""
    want = set(range(cluster.roles.num_processes)) - {cluster.process_id}
    deadline = time.monotonic() + timeout_s
    while want:
        want -= {m.process_id for m in transport.recv("hello")}
        cluster.check_peers()
        if time.monotonic() > deadline:
            raise PeerFailure(f"process(es) {sorted(want)} never connected to the learner lead")
        transport.wait(0.05)


def build_process(config, cluster: Cluster, transport, key: bytes | None = None) -> _Process:
    """Validates `config` and builds the roles of this process (compiles nothing but the init); `key` is the
    run's secret (a replica that spans processes signs its own channel with it)."""
    run = build.validate_for(config, cluster)
    proc = _Process(run, cluster)
    proc.key = key
    roles, pid = cluster.roles, cluster.process_id
    tokenizer = build.build_tokenizer(run)
    model_cfg = build.model_config(run, tokenizer)
    scfg = build.sampler_config(run, tokenizer)
    os.makedirs(run.workdir, exist_ok=True)
    t_mesh = build.trainer_mesh(run, cluster)
    local_weights = None
    if pid in roles.trainers:
        local_weights = _build_trainer(proc, run, cluster, transport, tokenizer, model_cfg, t_mesh)
    if pid in roles.samplers:
        _build_actor(proc, run, cluster, transport, tokenizer, model_cfg, scfg, t_mesh, local_weights)
    elif pid not in roles.trainers:
        _build_member(proc, run, cluster, tokenizer, model_cfg, scfg, t_mesh)
    return proc


def _pull_index(roles: Roles, pid: int) -> int:
    """Which pull of each weight version is process `pid`'s: one per sampler process, replicas in order
    (with one process per replica: the actor's index)."""
    return [p for r in roles.replicas for p in r].index(pid)


def _pull_targets(run, cluster) -> dict:
    """The publisher's view of the members of replicas that span processes: pull -> (the replica's mesh,
    the member's pid); each such pull takes only the pieces that member's devices hold."""
    targets = {}
    for i, members in enumerate(cluster.roles.replicas):
        if len(members) > 1:
            mesh = build.sampler_mesh(run, cluster, i)
            targets.update({_pull_index(cluster.roles, p): (mesh, p) for p in members})
    return targets


def _build_trainer(proc, run, cluster, transport, tokenizer, model_cfg, t_mesh):
    roles, lead = cluster.roles, cluster.is_lead
    if run.warm_start.enabled:
        if lead:
            params, proc.warm_start_info = build.warm_started_params(
                run, model_cfg, tokenizer, t_mesh.devices.flat[0], show=True
            )
            for p in roles.trainers[1:]:
                transport.send(f"trainer:{p}", WarmStartParams(params))
        else:
            params = _wait_for(transport, f"trainer:{cluster.process_id}", cluster).params
    else:
        params = build.initial_params(run, model_cfg, t_mesh)
    state = build.train_state(run, model_cfg, t_mesh, params)
    ckpts = build.checkpoints(run, cluster, model_cfg)
    proc.closers.append(ckpts.close)
    coordinator_state = None
    restored = ckpts.restore_latest(state)
    if restored is not None:
        state, version, coordinator_state = restored
        log.info("resumed from %s at version %d", ckpts.directory, version)
    if roles.multi:
        publisher = TransferPublisher(
            cluster, model_cfg, t_mesh, tuple(run.mesh.sampler), sampler_dtype(model_cfg),
            sum(map(len, roles.replicas)), run.verify_weights, targets=_pull_targets(run, cluster),
        )  # fmt: skip
        local_weights = None
    else:
        s_mesh = build.sampler_mesh(run, cluster)
        sync = WeightSync(model_cfg, s_mesh, dtype=sampler_dtype(model_cfg))
        publisher = local_weights = LocalWeights(sync, run.verify_weights)
    publisher = lagged(publisher, run.trainer.controlled_lag, run.schedule.total_steps)  # samplers get v - k
    core = TrainerCore(state, run.trainer, publisher, ckpts)
    if not lead:
        proc.follower = Follower(core, transport, cluster.process_id)
        proc.roles.append(proc.follower)
        return None
    prompts = make_prompt_iterator(run.data, tokenizer)
    coordinator = Coordinator(
        prompts,
        run.schedule.prompts_per_step,
        run.schedule.eta,
        transport,
        core.version,
        coordinator_state or None,
        lookup=functools.partial(prompt_at, run.data, tokenizer),
        trained_log=os.path.join(run.workdir, "trained_uids.jsonl"),
    )
    proc.coordinator = coordinator
    proc.closers.append(coordinator.close)
    writer = MetricsWriter(run.workdir, enabled=True)
    proc.closers.append(writer.close)
    lcfg = LearnerConfig(
        schedule=run.schedule,
        log=run.log,
        checkpoint=run.checkpoint,
        followers=tuple(f"trainer:{p}" for p in roles.trainers[1:]),
        actors=len(roles.samplers),
        dynamic_sampling=run.trainer.dynamic_sampling,
        dynamic_sampling_patience=run.trainer.dynamic_sampling_patience,
    )
    if roles.multi:
        _await_hellos(transport, cluster)
    proc.learner = Learner(lcfg, core, transport, writer, lambda: _snapshot(coordinator))
    proc.roles += [proc.coordinator, proc.learner]
    return local_weights


def _snapshot(coordinator: Coordinator) -> dict:
    """The coordinator's state for a checkpoint, once it has taken in the learner's last `Trained` (the
    ledger must agree with the train state saved beside it)."""
    coordinator.poll()
    return coordinator.state()


def _wait_for(transport, endpoint: str, cluster: Cluster, timeout_s: float = 3600.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = transport.recv(endpoint)
        if got:
            return got[0]
        cluster.check_peers()
        transport.wait(0.05)
    raise PeerFailure(f"{endpoint}: nothing arrived from the learner lead within {timeout_s:.0f} s")


def _build_actor(proc, run, cluster, transport, tokenizer, model_cfg, scfg, t_mesh, local_weights):
    roles, pid = cluster.roles, cluster.process_id
    index = roles.samplers.index(pid)
    s_mesh = build.sampler_mesh(run, cluster)
    engine, eval_engine = build.build_engines(run, model_cfg, s_mesh, scfg)
    rewards = RewardService(run.reward)
    proc.closers.append(rewards.close)
    if local_weights is not None:
        weights = local_weights
    else:
        pull = _pull_index(roles, pid)
        weights = TransferReceiver(cluster, pull, model_cfg, t_mesh, s_mesh, sampler_dtype(model_cfg))
    acfg = ActorConfig(
        index=index, seed=run.seed, schedule=run.schedule, eval=run.eval, reward=run.reward,
        verify_weights=run.verify_weights,
    )
    eval_prompts = held_out_prompts(run.data, tokenizer, run.eval.prompts) if index == 0 else []
    caps = length_cap_fn(run.length_caps) if run.length_caps else None
    rewards.wait_ready()
    members = None
    if len(roles.replicas[index]) > 1:
        members = Members(cluster, index, roles.replicas[index][1:], proc.key)
        proc.closers.append(members.close)
    proc.actor = Actor(
        acfg, engine, eval_engine, rewards, tokenizer, eval_prompts, transport, weights, caps, members
    )
    proc.roles.insert(0, proc.actor)


def _build_member(proc, run, cluster, tokenizer, model_cfg, scfg, t_mesh):
    """A member of a replica that spans processes (not its leader): the leader's engines, replayed."""
    roles, pid = cluster.roles, cluster.process_id
    index = next(i for i, r in enumerate(roles.replicas) if pid in r)
    s_mesh = build.sampler_mesh(run, cluster)
    engine, eval_engine = build.build_engines(run, model_cfg, s_mesh, scfg)
    pull = _pull_index(roles, pid)
    weights = TransferReceiver(cluster, pull, model_cfg, t_mesh, s_mesh, sampler_dtype(model_cfg))
    eval_prompts = held_out_prompts(run.data, tokenizer, run.eval.prompts) if index == 0 else []
    proc.member = ReplicaMember(
        cluster, index, engine, eval_engine, eval_prompts, weights, run.verify_weights, proc.key
    )
    proc.closers.append(proc.member.close)
    proc.roles.append(proc.member)


def build_local(config) -> _Process:
    """Every role of a one-process run, built but not started (for tools that drive the roles)."""
    cluster = single_process()
    build.validate(config, num_devices=None)
    transport = _transport(cluster, None)
    proc = build_process(config, cluster, transport)
    proc.closers.append(transport.close)
    return proc


class _StopSignals:
    """SIGTERM / SIGINT ask the run to save and stop (the learner lead does it); a second SIGINT aborts."""

    def __init__(self):
        self.received: str | None = None
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _event_loop(proc: _Process, transport, signals: _StopSignals) -> None:
    """Polls this process's roles until its part of the run is over."""
    cluster = proc.cluster
    done = (
        (lambda: proc.learner.done)
        if proc.learner is not None
        else (lambda: proc.actor.done)
        if proc.actor is not None
        else (lambda: proc.member.done)
        if proc.member is not None
        else (lambda: proc.follower.done)
    )
    # A member sleeps on its leader's channel: the next decode call's command ends the wait at once.
    wait = proc.member.wait if proc.member is not None else transport.wait
    asked_to_stop = False
    last = time.monotonic()
    while not done():
        if signals.received and not asked_to_stop:
            asked_to_stop = True
            if proc.learner is not None:
                proc.learner.preempt(f"{signals.received} received")
            else:
                transport.send("learner", Preempt(cluster.process_id, signals.received))
        progress = False
        for role in proc.roles:
            progress = role.poll() or progress
        cluster.check_peers()
        now = time.monotonic()
        if progress:
            last = now
        else:
            wait(0.002) if cluster.roles.multi else time.sleep(0.0005)
            if now - last > STALL_WARNING_S:  # say what every role waits for (a slow step, or a bug)
                log.warning(
                    "no progress for %.0f s: %s", now - last, " | ".join(r.describe() for r in proc.roles)
                )
                last = now


def run_from_config(config, cluster: Cluster | None = None) -> dict[str, Any] | None:
    """Validates `config`, builds this process's roles and runs them; the entry point of launch/run.py.

    Returns the run summary on the learner lead (also written to workdir/summary.json), None elsewhere.
    """
    cluster = cluster or single_process()
    build.validate(config, num_devices=None)  # fail on the config before connecting anything
    key = secret.load() if cluster.roles.multi else None  # it leaves the environment here
    transport = _transport(cluster, key)
    proc = None
    signals = _StopSignals()
    try:
        proc = build_process(config, cluster, transport, key)
        t0 = time.perf_counter()
        _event_loop(proc, transport, signals)
        if proc.learner is None:
            return None
        return _summary(proc, time.perf_counter() - t0)
    finally:
        signals.restore()
        if proc is not None:
            proc.close()
        transport.close()


def _summary(proc: _Process, wall: float) -> dict[str, Any]:
    run, learner = proc.run, proc.learner
    actor0 = learner.final_reports.get(0)
    summary = {
        "mode": run.schedule.mode,
        "max_staleness": run.schedule.eta,
        "loss": run.trainer.loss,
        "processes": proc.cluster.roles.num_processes,
        "wall_s": wall,
        **learner.summary(),
        **proc.coordinator.summary(),
        "warm_start": proc.warm_start_info,
        "reward_stats": actor0 and actor0.reward_stats,
        "eval_spans": actor0 and actor0.eval_spans,
        "sample_calls_during_eval": actor0 and actor0.sample_calls_during_eval,
        "trainer_during_eval": trainer_idle_during(actor0 and actor0.eval_spans, learner.step_spans),
        # replicas that span processes: when each member applied each version, the tokens it decoded
        "replicas": {f"actor:{i}": s.replica for i, s in learner.final_reports.items() if s.replica},
    }
    with open(os.path.join(run.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary
