"""The orchestrator's assembly: validated config -> meshes, model, warm start, trainer, sampler, rewards.

Part of the orchestrator (the only place that knows every component); kept apart from the loop so each
stays small.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
from tqdm import tqdm

from jaxrl_async.checkpoint import RunCheckpoints, write_model_info
from jaxrl_async.data import held_out_prompts, make_prompt_iterator, reference_completion
from jaxrl_async.data.prompt import SYNTHETIC_TASKS
from jaxrl_async.evaluation import evaluate_accuracy
from jaxrl_async.model import ModelConfig, init_params, load_hf, presets
from jaxrl_async.rewards import RewardService
from jaxrl_async.run_config import ConfigError, RunConfig, validate
from jaxrl_async.sampler import Engine, SamplerConfig
from jaxrl_async.sharding import TRAINER_RULES, make_mesh
from jaxrl_async.tokenizer import Tokenizer, load_tokenizer
from jaxrl_async.trainer import TrainState, create_train_state
from jaxrl_async.warmstart import cache_key, warm_start
from jaxrl_async.weight_sync import WeightSync

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Setup:
    """Every built part of a run (mutable: the trainer thread replaces `state`)."""

    run: RunConfig
    tokenizer: Tokenizer
    model_cfg: ModelConfig
    sampler_mesh: Any
    trainer_mesh: Any
    state: TrainState
    weight_sync: WeightSync
    engine: Engine
    eval_engine: Engine
    rewards: RewardService
    checkpoints: Any = None
    warm_start_info: dict | None = None
    _engine_params: Any = None

    def engine_params(self):
        return self._engine_params

    def set_engine_params(self, params) -> None:
        self._engine_params = params

    def progress(self, total: int, desc: str):
        return tqdm(total=total, desc=desc, disable=jax.process_index() != 0, dynamic_ncols=True)

    def save_checkpoint(self, version: int, data_iter) -> None:
        if self.checkpoints is not None:
            self.checkpoints.save(version, self.state, data_iter)

    def close(self) -> None:
        self.rewards.close()
        if self.checkpoints is not None:
            self.checkpoints.close()


def _tokenizer_path(run: RunConfig) -> str:
    path = run.tokenizer or run.model.get("checkpoint") or "char"
    return path if path == "char" else os.path.abspath(path)


def _tokenizer(run: RunConfig) -> Tokenizer:
    path = _tokenizer_path(run)
    if path != "char" and not os.path.isdir(path):
        raise ConfigError(
            f"config.tokenizer / config.model.checkpoint: tokenizer directory {path!r} not found"
        )
    return load_tokenizer(path)


def _model(run: RunConfig, tokenizer: Tokenizer, mesh) -> tuple[ModelConfig, dict]:
    m = run.model
    if m.get("checkpoint"):
        if not os.path.isdir(m["checkpoint"]):
            raise ConfigError(f"config.model.checkpoint: directory {m['checkpoint']!r} not found")
        return load_hf(m["checkpoint"], dtype=m["dtype"], mesh=mesh, rules=TRAINER_RULES)
    vocab = m.get("vocab_size") or -(-tokenizer.vocab_size // 8) * 8
    if vocab < tokenizer.vocab_size:
        raise ConfigError(f"config.model.vocab_size={vocab} < the tokenizer's {tokenizer.vocab_size}")
    need = run.sampler.slot_len
    cfg = presets.get(
        m["preset"], vocab_size=vocab, dtype=m["dtype"], param_dtype=m["dtype"], eos_token_id=tokenizer.eos_id
    )
    if m.get("n_layers"):
        cfg = cfg.replace(n_layers=int(m["n_layers"]))
    if cfg.max_seq_len < need:
        cfg = cfg.replace(max_seq_len=need)
    return cfg, init_params(cfg, jax.random.key(run.seed), mesh, TRAINER_RULES)


def _sampler_config(run: RunConfig, tokenizer: Tokenizer) -> SamplerConfig:
    cfg = run.sampler
    if not cfg.stop_tokens:
        cfg = dataclasses.replace(cfg, stop_tokens=(tokenizer.eos_id,))
    if abs(cfg.logprob_temperature - run.trainer.temperature) > 1e-9:
        raise ConfigError(
            f"config.trainer.temperature={run.trainer.temperature} must equal the sampler's "
            f"logprob temperature {cfg.logprob_temperature} (config.sampler.temperature)"
        )
    return cfg


def _meshes(run: RunConfig):
    devices = jax.devices()
    ns, nt = run.mesh.sampler_devices, run.mesh.trainer_devices
    if run.mesh.devices_needed > len(devices):
        raise ConfigError(f"config.mesh: needs {run.mesh.devices_needed} devices, {len(devices)} present")
    first = 0 if run.mesh.colocate else ns
    sampler = make_mesh(run.mesh.sampler, ("data", "tensor"), devices[:ns])
    trainer = make_mesh(run.mesh.trainer, ("fsdp", "tensor"), devices[first : first + nt])
    return sampler, trainer


def _warm_start(run: RunConfig, setup: Setup, params: dict) -> tuple[dict, dict | None]:
    if not run.warm_start.enabled:
        return params, None
    if run.data.task not in SYNTHETIC_TASKS:
        raise ConfigError(
            f"config.warm_start.enabled: needs a synthetic task (reference completions), "
            f"data.task={run.data.task!r}"
        )
    tok = setup.tokenizer
    data_cfg = dataclasses.replace(run.data, num_epochs=None, seed=run.data.seed + 7919)
    it = make_prompt_iterator(data_cfg, tok)
    examples = ((p.tokens, tok.encode(reference_completion(p.text)) + [tok.eos_id]) for p in it)
    eval_prompts = held_out_prompts(run.data, tok, run.eval_prompts)  # the RL run's own eval set
    evaluate = lambda p: evaluate_accuracy(
        setup.eval_engine, setup.rewards, tok, eval_prompts, setup.weight_sync(p), 0
    )
    key = cache_key(setup.model_cfg, run.data, run.warm_start, run.seed, tok.vocab_size, run.eval_prompts)
    bar = setup.progress(run.warm_start.max_steps, "warm start")
    try:
        params, info = warm_start(
            setup.model_cfg,
            params,
            examples,
            evaluate,
            run.warm_start,
            key,
            progress=lambda step, total: bar.update(1),
        )
    finally:
        bar.close()
    log.info("warm start: %s", info)
    return params, info


def build_setup(config) -> Setup:
    """Validates `config` (before anything compiles) and builds every part of the run."""
    run = validate(config, num_devices=len(jax.devices()))
    tokenizer = _tokenizer(run)
    sampler_cfg = _sampler_config(run, tokenizer)
    sampler_mesh, trainer_mesh = _meshes(run)
    model_cfg, params = _model(run, tokenizer, trainer_mesh)
    if sampler_cfg.slot_len > model_cfg.max_seq_len:
        raise ConfigError(
            f"config.sampler: slot length {sampler_cfg.slot_len} exceeds the model's "
            f"max_seq_len {model_cfg.max_seq_len}"
        )
    os.makedirs(run.workdir, exist_ok=True)
    sync = WeightSync(model_cfg, sampler_mesh)
    sampler_params = sync(params)
    engine = Engine(model_cfg, sampler_params, sampler_mesh, sampler_cfg)
    data = sampler_mesh.shape["data"]
    eval_slots = data * max(1, min(sampler_cfg.num_slots, 64) // data)  # a multiple of the data axis
    eval_cfg = dataclasses.replace(
        sampler_cfg,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        num_slots=eval_slots,
        token_budget=eval_slots * sampler_cfg.slot_len,
    )
    eval_engine = Engine(model_cfg, sampler_params, sampler_mesh, eval_cfg)
    rewards = RewardService(run.reward)
    setup = Setup(
        run=run,
        tokenizer=tokenizer,
        model_cfg=model_cfg,
        sampler_mesh=sampler_mesh,
        trainer_mesh=trainer_mesh,
        state=None,
        weight_sync=sync,
        engine=engine,
        eval_engine=eval_engine,
        rewards=rewards,
    )
    params, setup.warm_start_info = _warm_start(run, setup, params)
    setup.state = create_train_state(run.trainer, model_cfg, params, trainer_mesh)
    setup.set_engine_params(sync(setup.state.params))
    engine.update_params(setup.engine_params(), 0)
    setup.checkpoints = RunCheckpoints(os.path.join(run.workdir, "checkpoints"))
    write_model_info(setup.checkpoints.directory, model_cfg, _tokenizer_path(run))
    return setup


def resume(setup: Setup, data_iter) -> int:
    """Restores the latest checkpoint of the workdir (train state and data position); returns its version."""
    restored = setup.checkpoints.restore_latest(setup.state, data_iter)
    if restored is None:
        return 0
    setup.state, version = restored
    setup.set_engine_params(setup.weight_sync(setup.state.params))
    setup.engine.update_params(setup.engine_params(), version)
    log.info("resumed from %s at version %d", setup.checkpoints.directory, version)
    return version
