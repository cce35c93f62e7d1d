"""The run's assembly, role by role: validated config -> meshes, model, engines, train state, rewards.

Part of the orchestrator (the only place that knows every component). Each builder makes the parts of
one role and hands them to it; no object is shared between roles.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax
import numpy as np
from tqdm import tqdm

from jaxrl_async.data import held_out_prompts, make_prompt_iterator, reference_completion
from jaxrl_async.data.prompt import SYNTHETIC_TASKS
from jaxrl_async.model import ModelConfig, from_hf_config, init_params, load_hf, param_shardings, presets
from jaxrl_async.rewards import RewardService
from jaxrl_async.run_config import ConfigError, RunConfig, validate
from jaxrl_async.runtime.checkpoint import RunCheckpoints, write_model_info
from jaxrl_async.runtime.cluster import ClusterError, check_placement, devices_per_process
from jaxrl_async.runtime.evaluation import eval_sampler_config, evaluate_accuracy
from jaxrl_async.sampler import Engine, SamplerConfig
from jaxrl_async.sharding import TRAINER_RULES, make_mesh
from jaxrl_async.tokenizer import Tokenizer, load_tokenizer
from jaxrl_async.trainer import TrainState, create_train_state
from jaxrl_async.trainer.warmstart import cache_key, warm_start

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
    path = run.tokenizer or run.model.checkpoint or "char"
    return path if path == "char" else os.path.abspath(path)


def build_tokenizer(run: RunConfig) -> Tokenizer:
    path = tokenizer_path(run)
    if path != "char" and not os.path.isdir(path):
        raise ConfigError(
            f"config.tokenizer / config.model.checkpoint: tokenizer directory {path!r} not found"
        )
    return load_tokenizer(path)


def model_config(run: RunConfig, tokenizer: Tokenizer) -> ModelConfig:
    """The model's shape from the HF checkpoint's config.json or the preset (no weights are read)."""
    m = run.model
    if m.checkpoint:
        with open(os.path.join(m.checkpoint, "config.json")) as f:
            cfg = from_hf_config(json.load(f), m.dtype, m.param_dtype, m.attention)
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


def build_engines(run: RunConfig, model_cfg: ModelConfig, mesh, sampler_cfg: SamplerConfig):
    """The sampling engine and the greedy evaluation engine on one sampler mesh (weights in the compute
    dtype, arriving with the first published version). The eval engine holds weights of its own (an
    evaluation runs beside sampling with the version it evaluates, runtime/evaluation.py), or shares the
    sampler's with config.eval_weights="shared"."""
    weights_cfg = model_cfg.compute_copy()
    engine = Engine(weights_cfg, None, mesh, sampler_cfg)
    eval_cfg = eval_sampler_config(engine.cfg, mesh.shape["data"], run.eval.slots)  # the kernels it chose
    shared = engine if run.eval.weights == "shared" else None  # config.eval_weights
    return engine, Engine(weights_cfg, None, mesh, eval_cfg, weights_from=shared)


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
    examples = ((p.tokens, tokenizer.encode(reference_completion(p.text)) + [tokenizer.eos_id]) for p in it)
    eval_prompts = held_out_prompts(run.data, tokenizer, run.eval.prompts)  # the RL run's own eval set
    evaluator = _WarmStartEval(run, model_cfg, tokenizer, device, eval_prompts)
    key = cache_key(model_cfg, run.data, run.warm_start, run.seed, tokenizer.vocab_size, run.eval.prompts)
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
            scfg = dataclasses.replace(
                sampler_config(self.run, self.tokenizer), attention="xla", linear="xla"
            )
            self.engine = build_engines(self.run, self.model_cfg, mesh, scfg)[1]
            self.sync = WeightSync(self.model_cfg, mesh)
            self.rewards = RewardService(self.run.reward)
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
    return create_train_state(run.trainer, model_cfg, params, mesh, ref_params=ref)


def checkpoints(run: RunConfig, cluster, model_cfg: ModelConfig) -> RunCheckpoints:
    roles = cluster.roles
    ckpt = RunCheckpoints(
        os.path.join(run.workdir, "checkpoints"),
        keep=run.checkpoint.keep,
        processes=roles.trainers if roles.multi else None,
    )
    if cluster.is_lead:
        write_model_info(ckpt.directory, model_cfg, tokenizer_path(run))
    return ckpt
