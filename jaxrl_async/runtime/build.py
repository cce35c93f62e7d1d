"""The run's assembly: validated config -> meshes, model, engines, train state, rewards, and from them the
roles of one process (`build_process`: coordinator, learner, follower, actor, replica member, as
`cluster.Roles` says), wired to their transport.

The only module that knows every component (the orchestrator runs what it builds). Each builder makes the
parts of one role and hands them to it; no object is shared between roles.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time

import jax
import numpy as np
from tqdm import tqdm

from jaxrl_async import storage
from jaxrl_async.data import held_out_prompts, make_prompt_iterator, prompt_at, reference_completion
from jaxrl_async.data.calc_tool import reference_segments
from jaxrl_async.data.length_caps import length_cap_fn
from jaxrl_async.data.prompt import SYNTHETIC_TASKS
from jaxrl_async.model import ModelConfig, from_hf_config, init_params, load_hf, param_shardings, presets
from jaxrl_async.rewards import RewardService
from jaxrl_async.run_config import ConfigError, RunConfig, clip_note, validate
from jaxrl_async.runtime.actor import Actor, ActorConfig
from jaxrl_async.runtime.checkpoint import RunCheckpoints, write_model_info
from jaxrl_async.runtime.cluster import (
    Cluster,
    ClusterError,
    PeerFailure,
    Roles,
    check_placement,
    devices_per_process,
)
from jaxrl_async.runtime.coordinator import Coordinator
from jaxrl_async.runtime.episodes import episode_kernels, grade_greedy_episodes
from jaxrl_async.runtime.evaluation import eval_sampler_config, evaluate_accuracy, weighted_accuracy
from jaxrl_async.runtime.lag import lagged
from jaxrl_async.runtime.learner import Follower, Learner, LearnerConfig, TrainerCore
from jaxrl_async.runtime.lora_checkpoint import save_base
from jaxrl_async.runtime.messages import Hello, WarmStartParams
from jaxrl_async.runtime.metrics import MetricsWriter
from jaxrl_async.runtime.replica import Members, ReplicaMember
from jaxrl_async.runtime.schedule_log import ActorSchedule, LearnerSchedule, ScheduleWriter, schedule_path
from jaxrl_async.runtime.transport import LocalTransport, ZmqTransport
from jaxrl_async.runtime.weight_roles import sampler_receiver, trainer_publisher
from jaxrl_async.sampler import Engine, SamplerConfig
from jaxrl_async.sharding import TRAINER_RULES, make_mesh
from jaxrl_async.tokenizer import Tokenizer, load_tokenizer
from jaxrl_async.trainer import TrainState, create_train_state
from jaxrl_async.trainer.warmstart import cache_key, episode_example, warm_start

log = logging.getLogger(__name__)


def progress_bar(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True)


# ----- config, tokenizer, model -----


def validate_for(config, cluster) -> RunConfig:
    """Validates `config` and checks that each role of this process has the devices it needs."""
    run = validate(config, num_devices=len(jax.devices()) if not cluster.roles.multi else None)
    try:
        check_placement(run.mesh, cluster.roles, devices_per_process(jax.devices()))
    except ClusterError as e:
        raise ConfigError(str(e)) from None
    return run


def tokenizer_path(run: RunConfig) -> str:
    """The tokenizer's directory as given (absolute if local; a gs:// URL stays one, so model.json names a
    place every host can read), or "char"."""
    path = run.tokenizer or run.model.checkpoint or "char"
    return path if path == "char" else storage.resolve(path)


def build_tokenizer(run: RunConfig) -> Tokenizer:
    path = tokenizer_path(run)
    if path != "char" and not storage.isdir(path):
        raise ConfigError(
            f"config.tokenizer / config.model.checkpoint: tokenizer directory {path!r} not found"
        )
    return load_tokenizer(path)


def model_config(run: RunConfig, tokenizer: Tokenizer) -> ModelConfig:
    """The model's shape from the HF checkpoint's config.json or the preset (no weights are read)."""
    m = run.model
    if m.checkpoint:
        text = storage.read_text(storage.join(m.checkpoint, "config.json"))
        cfg = from_hf_config(json.loads(text), m.dtype, m.param_dtype, m.attention)
    else:
        vocab = m.vocab_size or -(-tokenizer.vocab_size // 8) * 8
        if vocab < tokenizer.vocab_size:
            raise ConfigError(f"config.model.vocab_size={vocab} < the tokenizer's {tokenizer.vocab_size}")
        cfg = presets.get(
            m.preset,
            vocab_size=vocab,
            dtype=m.dtype,
            param_dtype=m.dtype,
            eos_token_id=tokenizer.eos_id,
        )
        if m.n_layers:
            cfg = cfg.replace(n_layers=m.n_layers)
        if cfg.max_seq_len < run.sampler.slot_len:
            cfg = cfg.replace(max_seq_len=run.sampler.slot_len)
    if run.sampler.slot_len > cfg.max_seq_len:
        raise ConfigError(
            f"config.sampler: slot length {run.sampler.slot_len} exceeds the model's "
            f"max_seq_len {cfg.max_seq_len}"
        )
    if run.trainer.lora.enabled:  # before anything compiles: a rank the targets cannot hold
        try:
            run.trainer.lora.check_model(cfg)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return cfg


def sampler_config(run: RunConfig, tokenizer: Tokenizer) -> SamplerConfig:
    cfg = run.sampler
    if not cfg.stop_tokens:
        cfg = dataclasses.replace(cfg, stop_tokens=(tokenizer.eos_id,))
    return cfg


# ----- meshes -----


def sampler_mesh(run: RunConfig, cluster, replica: int | None = None):
    """A sampler replica's mesh (default: this process's): the first devices of its one process, or the
    devices of its processes in member order when it spans several (one process: the first devices of
    all). Every process can build any replica's mesh; only its members compute on it."""
    roles = cluster.roles
    if not roles.multi:
        devices = jax.devices()
    else:
        if replica is None:
            replica = next(i for i, r in enumerate(roles.replicas) if cluster.process_id in r)
        members = roles.replicas[replica]
        devices = sorted(
            (d for d in jax.devices() if d.process_index in members),
            key=lambda d: (members.index(d.process_index), d.id),
        )
    return make_mesh(run.mesh.sampler, ("data", "tensor"), devices[: run.mesh.sampler_devices])


def trainer_mesh(run: RunConfig, cluster):
    """The trainer mesh: the trainer processes' devices in process order (one process: after the
    sampler's, or the same ones when colocated). Every process can build it; only trainers use it."""
    m = run.mesh
    if cluster.roles.multi:
        devices = sorted(
            (d for d in jax.devices() if d.process_index in cluster.roles.trainers),
            key=lambda d: (cluster.roles.trainers.index(d.process_index), d.id),
        )
    else:
        devices = jax.devices()[0 if m.colocate else m.sampler_devices :]
    return make_mesh(m.trainer, ("fsdp", "tensor"), devices[: m.trainer_devices])


# ----- sampler side -----


def build_engines(run: RunConfig, model_cfg: ModelConfig, mesh, sampler_cfg: SamplerConfig, compile_fn=None):
    """The sampling engine and the greedy evaluation engine on one sampler mesh (weights in the compute
    dtype, arriving with the first published version). The eval engine holds weights of its own (an
    evaluation runs beside sampling with the version it evaluates, runtime/evaluation.py), or shares the
    sampler's with config.eval_weights="shared". `compile_fn`: see `Engine`."""
    weights_cfg = model_cfg.compute_copy()
    if run.env.enabled:  # observations are appended by XLA ops: no "auto" CPU kernel (episodes.py)
        sampler_cfg = episode_kernels(sampler_cfg, model_cfg, mesh, run.env.max_episode_tokens)
    # Built before the first version arrives: "auto" kernels are timed on random weights (sampler/engine.py).
    # LoRA with lora_apply="unmerged": the engines' layers carry the adapters beside the base.
    lora = run.trainer.lora if run.trainer.lora.enabled and sampler_cfg.lora_apply == "unmerged" else None
    engine = Engine(weights_cfg, None, mesh, sampler_cfg, compile_fn=compile_fn, time_kernels=True, lora=lora)
    eval_cfg = eval_sampler_config(engine.cfg, mesh.shape["data"], run.eval.slots)  # the kernels it chose
    shared = engine if run.eval.weights == "shared" else None  # config.eval_weights
    eval_engine = Engine(weights_cfg, None, mesh, eval_cfg, weights_from=shared, compile_fn=compile_fn,
                         lora=lora)  # fmt: skip
    log.info("sampling engine: %s", engine.describe())
    log.info("evaluation engine: %s", eval_engine.describe())
    return engine, eval_engine


# ----- trainer side -----


def initial_params(run: RunConfig, model_cfg: ModelConfig, mesh):
    """Fresh parameters on the trainer mesh: the HF checkpoint's or a random init (every trainer process
    calls this: it is one SPMD computation)."""
    m = run.model
    if m.checkpoint:
        kw = dict(param_dtype=m.param_dtype, attention=m.attention, mesh=mesh, rules=TRAINER_RULES)
        return load_hf(m.checkpoint, dtype=m.dtype, **kw)[1]
    return init_params(model_cfg, jax.random.key(run.seed), mesh, TRAINER_RULES)


def warm_started_params(run: RunConfig, model_cfg: ModelConfig, tokenizer: Tokenizer, device, show: bool):
    """Runs (or loads from its cache) the supervised warm start on one device of the learner lead.

    Returns host arrays (every trainer process places them on the trainer mesh) and the warm start info.
    """
    if run.data.task not in SYNTHETIC_TASKS:
        raise ConfigError(
            f"config.warm_start.enabled: needs a synthetic task (reference completions), "
            f"data.task={run.data.task!r}"
        )
    mesh = make_mesh((1, 1), ("fsdp", "tensor"), [device])
    params = init_params(model_cfg, jax.random.key(run.seed), mesh, TRAINER_RULES)
    data_cfg = dataclasses.replace(run.data, num_epochs=None, seed=run.data.seed + 7919)
    it = make_prompt_iterator(data_cfg, tokenizer)
    examples = (reference_example(run.data.task, tokenizer, p) for p in it)
    eval_prompts = held_out_prompts(run.data, tokenizer, run.eval.prompts)  # the RL run's own eval set
    evaluator = _WarmStartEval(run, model_cfg, tokenizer, device, eval_prompts)
    key_parts = [model_cfg, run.data, run.warm_start, run.seed, tokenizer.vocab_size, run.eval.prompts]
    if run.env.enabled:  # its check runs episodes under these bounds, so where it stops depends on them
        key_parts.append(run.env)
    key = cache_key(*key_parts)
    bar = progress_bar(run.warm_start.max_steps, "warm start", show)
    try:
        params, info = warm_start(
            model_cfg, params, examples, evaluator, run.warm_start, key, progress=lambda s, t: bar.update(1)
        )
    finally:
        bar.close()
        evaluator.close()
    log.info("warm start: %s", info)
    return jax.tree.map(np.asarray, params), info


def reference_example(task: str, tokenizer: Tokenizer, prompt) -> tuple:
    """A warm-start example for `prompt`: (prompt ids, reference completion ids + eos), or for the
    calc_tool task the whole reference episode with the calculator's results masked out of the loss
    (prompt ids, completion ids, model mask; `warmstart.episode_example`)."""
    if task == "calc_tool":
        segments = reference_segments(prompt.text)
        return episode_example(tokenizer.encode, tokenizer.eos_id, prompt.tokens, segments)
    return prompt.tokens, tokenizer.encode(reference_completion(prompt.text)) + [tokenizer.eos_id]


class _WarmStartEval:
    """Held-out accuracy for the warm start: a greedy engine and a reward pool, built on first use."""

    def __init__(self, run, model_cfg, tokenizer, device, prompts):
        self.run, self.model_cfg, self.tokenizer, self.device, self.prompts = (
            run,
            model_cfg,
            tokenizer,
            device,
            prompts,
        )
        self.engine = self.rewards = None

    def __call__(self, params) -> float:
        from jaxrl_async.runtime.weight_sync import WeightSync

        if self.engine is None:
            mesh = make_mesh((1, 1), ("data", "tensor"), [self.device])
            # The warm start trains the whole model, before any adapter exists: its engine decodes the
            # plain tree, also in a LoRA run (lora_apply="merge" builds engines without adapter slots).
            scfg = dataclasses.replace(
                sampler_config(self.run, self.tokenizer), attention="xla", linear="xla", lora_apply="merge"
            )
            self.engine = build_engines(self.run, self.model_cfg, mesh, scfg)[1]
            self.sync = WeightSync(self.model_cfg, mesh)
            self.rewards = RewardService(self.run.reward)
        if self.run.env.enabled:  # a tool call is no answer: grade whole greedy episodes, tools included
            graded = grade_greedy_episodes(self.run.env, self.engine, self.rewards, self.tokenizer,
                                           self.prompts, self.sync(params), 0)  # fmt: skip
            return weighted_accuracy(graded)
        return evaluate_accuracy(
            self.engine, self.rewards, self.tokenizer, self.prompts, self.sync(params), 0
        )

    def close(self) -> None:
        if self.rewards is not None:
            self.rewards.close()


def train_state(run: RunConfig, model_cfg: ModelConfig, mesh, params) -> TrainState:
    """A fresh train state on the trainer mesh from device params or host arrays.

    With trainer.kl_coef > 0 the starting parameters (the HF checkpoint, the warm start or the init)
    are also the frozen KL reference. A resumed run restores only the policy and optimizer over this
    state, so its reference stays the starting policy."""
    if jax.tree.leaves(params) and isinstance(jax.tree.leaves(params)[0], np.ndarray):
        params = jax.device_put(params, param_shardings(model_cfg, mesh, TRAINER_RULES))
    ref = params if run.trainer.kl_coef > 0 else None
    key = jax.random.fold_in(jax.random.key(run.seed), 1)  # LoRA adapters: apart from the init's key
    return create_train_state(run.trainer, model_cfg, params, mesh, ref_params=ref, adapter_key=key)


def checkpoints(run: RunConfig, cluster, model_cfg: ModelConfig) -> RunCheckpoints:
    roles = cluster.roles
    ckpt = RunCheckpoints(
        storage.join(run.workdir, "checkpoints"),
        keep=run.checkpoint.keep,
        processes=roles.trainers if roles.multi else None,
    )
    if cluster.is_lead:
        write_model_info(ckpt.directory, model_cfg, tokenizer_path(run))
    return ckpt


# ----- one process's roles, put together ------------------------------------------------------------


def single_process() -> Cluster:
    """The cluster of a run without `jax.distributed`: one process, every role."""
    return Cluster(Roles(1, (0,), (0,)))


class Process:
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
        self.resumed_at: int | None = None  # the version a resumed run restored (the learner lead's)

    def close(self) -> None:
        for c in reversed(self.closers):
            try:
                c()
            except Exception:  # noqa: BLE001 - close everything else, then let the run's error surface
                log.exception("while closing")


def make_transport(cluster: Cluster, key: bytes | None):
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


def build_process(config, cluster: Cluster, transport, key: bytes | None = None, executables=None) -> Process:
    """Validates `config` and builds the roles of this process (compiles nothing but the init); `key` is the
    run's secret (a replica that spans processes signs its own channel with it); `executables`: this
    process's `compile_cache.ExecutableStore`, for a replica of its own."""
    run = validate_for(config, cluster)
    proc = Process(run, cluster)
    proc.key = key
    roles, pid = cluster.roles, cluster.process_id
    tokenizer = build_tokenizer(run)
    model_cfg = model_config(run, tokenizer)
    scfg = sampler_config(run, tokenizer)
    storage.makedirs(run.workdir)
    t_mesh = trainer_mesh(run, cluster)
    local_weights = None
    if pid in roles.trainers:
        local_weights = _build_trainer(proc, run, cluster, transport, tokenizer, model_cfg, t_mesh)
    if pid in roles.samplers:
        _build_actor(proc, run, cluster, transport, tokenizer, model_cfg, scfg, t_mesh, local_weights,
                     executables)  # fmt: skip
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
            mesh = sampler_mesh(run, cluster, i)
            targets.update({_pull_index(cluster.roles, p): (mesh, p) for p in members})
    return targets


def _build_trainer(proc, run, cluster, transport, tokenizer, model_cfg, t_mesh):
    roles, lead = cluster.roles, cluster.is_lead
    if lead and (note := clip_note(run)):
        log.warning(note)
    if run.warm_start.enabled:
        if lead:
            params, proc.warm_start_info = warm_started_params(
                run, model_cfg, tokenizer, t_mesh.devices.flat[0], show=True
            )
            for p in roles.trainers[1:]:
                transport.send(f"trainer:{p}", WarmStartParams(params))
        else:
            params = _wait_for(transport, f"trainer:{cluster.process_id}", cluster).params
    else:
        params = initial_params(run, model_cfg, t_mesh)
    state = train_state(run, model_cfg, t_mesh, params)
    ckpts = checkpoints(run, cluster, model_cfg)
    proc.closers.append(ckpts.close)
    if run.trainer.lora.enabled:  # the frozen base, once beside the steps (which hold the adapters)
        source = run.model.checkpoint or ("warm start" if run.warm_start.enabled else f"init seed {run.seed}")
        save_base(ckpts.directory, run.trainer.lora, state.frozen, source,
                  roles.trainers if roles.multi else None)  # fmt: skip
    coordinator_state = None
    restored = ckpts.restore_latest(state)
    if restored is not None:
        state, version, coordinator_state = restored
        log.info("resumed from %s at version %d", ckpts.directory, version)
        proc.resumed_at = version
    s_mesh = None if roles.multi else sampler_mesh(run, cluster)
    targets = _pull_targets(run, cluster) if roles.multi else {}
    publisher, local_weights = trainer_publisher(run, cluster, model_cfg, t_mesh, s_mesh, state.frozen,
                                                 targets)  # fmt: skip
    if roles.multi:
        proc.closers.append(publisher.close)
        # The first publish waits for every receiver to say how it takes the pieces; the train step and the
        # checksum are collectives over the trainer processes, whose rendezvous gives up after 30 s. So
        # every trainer process learns the paths first, and they meet (a coordination-service barrier,
        # not a collective) before any of them publishes or trains.
        publisher.resolve_paths()
        cluster.barrier("trainers_ready", roles.trainers)
    # samplers get v - k; at the end the due versions they skipped are evaluated (runtime/lag.py)
    last = run.schedule.total_steps
    publisher = lagged(publisher, run.trainer.controlled_lag, last, due=lambda v: run.eval.due(v, last))
    core = TrainerCore(state, run.trainer, publisher, ckpts)
    if not lead:
        proc.follower = Follower(core, transport, cluster.process_id)
        proc.roles.append(proc.follower)
        return None
    prompts = make_prompt_iterator(run.data, tokenizer)
    coordinator = Coordinator(
        prompts,
        run.schedule.prompts_per_step,
        run.schedule.effective_max_staleness,
        transport,
        core.version,
        coordinator_state or None,
        lookup=functools.partial(prompt_at, run.data, tokenizer),
        trained_log=storage.join(run.workdir, "trained_uids.jsonl"),
    )
    proc.coordinator = coordinator
    proc.closers.append(coordinator.close)
    writer = MetricsWriter(run.workdir, enabled=True)
    proc.closers.append(writer.close)
    lcfg = LearnerConfig(
        schedule=run.schedule,
        log=run.log,
        checkpoint=run.checkpoint,
        roles=roles,
    )
    if roles.multi:
        _await_hellos(transport, cluster)
    schedule = None
    if run.record_schedule:  # one trainer process: the fingerprint is no collective the followers must join
        path = schedule_path(run.workdir, "learner")
        schedule = LearnerSchedule(ScheduleWriter(path), fingerprints=len(roles.trainers) == 1)
        proc.closers.append(schedule.close)
    proc.learner = Learner(lcfg, core, transport, writer, lambda: _snapshot(coordinator), schedule)
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


def _build_actor(proc, run, cluster, transport, tokenizer, model_cfg, scfg, t_mesh, local_weights,
                 executables=None):  # fmt: skip
    roles, pid = cluster.roles, cluster.process_id
    index = roles.samplers.index(pid)
    s_mesh = sampler_mesh(run, cluster)
    # A replica over several processes compiles programs that span them: JAX's cache alone serves those.
    own = executables is not None and len(roles.replicas[index]) == 1
    compile_fn = executables.compiler(s_mesh.devices.flat) if own else None
    engine, eval_engine = build_engines(run, model_cfg, s_mesh, scfg, compile_fn)
    rewards = RewardService(run.reward)
    proc.closers.append(rewards.close)
    if local_weights is not None:
        weights = local_weights
    else:
        weights = sampler_receiver(run, cluster, model_cfg, t_mesh, s_mesh, _pull_index(roles, pid))
    acfg = ActorConfig(index=index, run=run, roles=roles)
    eval_prompts = held_out_prompts(run.data, tokenizer, run.eval.prompts) if index == 0 else []
    caps = length_cap_fn(run.length_caps) if run.length_caps else None
    rewards.wait_ready()
    members = None
    if len(roles.replicas[index]) > 1:
        members = Members(cluster, index, roles.replicas[index][1:], proc.key)
        proc.closers.append(members.close)
    schedule = None
    if run.record_schedule:
        endpoint = f"actor:{index}"
        schedule = ActorSchedule(ScheduleWriter(schedule_path(run.workdir, endpoint)), endpoint, engine.cfg)
        proc.closers.append(schedule.close)
    proc.actor = Actor(acfg, engine, eval_engine, rewards, tokenizer, eval_prompts, transport, weights, caps,
                       members, executables if own else None, schedule)  # fmt: skip
    if proc.actor.episodes is not None:
        proc.closers.append(proc.actor.episodes.close)
    proc.roles.insert(0, proc.actor)


def _build_member(proc, run, cluster, tokenizer, model_cfg, scfg, t_mesh):
    """A member of a replica that spans processes (not its leader): the leader's engines, replayed."""
    roles, pid = cluster.roles, cluster.process_id
    index = next(i for i, r in enumerate(roles.replicas) if pid in r)
    s_mesh = sampler_mesh(run, cluster)
    engine, eval_engine = build_engines(run, model_cfg, s_mesh, scfg)
    weights = sampler_receiver(run, cluster, model_cfg, t_mesh, s_mesh, _pull_index(roles, pid))
    eval_prompts = held_out_prompts(run.data, tokenizer, run.eval.prompts) if index == 0 else []
    proc.member = ReplicaMember(cluster, index, engine, eval_engine, eval_prompts, weights,
                                run.verify_weights, proc.key, episodes=run.env.enabled)  # fmt: skip
    proc.closers.append(proc.member.close)
    proc.roles.append(proc.member)


def build_local(config) -> Process:
    """Every role of a one-process run, built but not started (for tools that drive the roles)."""
    cluster = single_process()
    validate(config, num_devices=None)
    transport = make_transport(cluster, None)
    proc = build_process(config, cluster, transport)
    proc.closers.append(transport.close)
    return proc
