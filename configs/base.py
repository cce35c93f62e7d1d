"""Defaults shared by every run; configs/*.py import this and override.

Component sections (data, reward, sampler, trainer, warm_start, env) are built from the components' own
frozen dataclasses, whose docstrings document each field: jaxrl_async.data.DataConfig,
jaxrl_async.rewards.RewardConfig, jaxrl_async.sampler.SamplerConfig, jaxrl_async.trainer.TrainConfig,
jaxrl_async.trainer.warmstart.WarmStartConfig, jaxrl_async.envs.EnvConfig. Override any field with
--config.<section>.<field>=value.
"""

import ml_collections

from jaxrl_async.data import DataConfig
from jaxrl_async.envs import EnvConfig
from jaxrl_async.rewards import RewardConfig
from jaxrl_async.run_config import MeshConfig, ModelSection, dataclass_section
from jaxrl_async.sampler import SamplerConfig
from jaxrl_async.trainer import TrainConfig
from jaxrl_async.trainer.warmstart import WarmStartConfig


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.workdir = ""  # Where TensorBoard events (workdir/tb), checkpoints and the run log go. Required.
    # Seeds parameter init (without a checkpoint) and each prompt's sampling stream; the data's order and
    # synthetic problems are config.data.seed's.
    c.seed = 0
    c.mode = (
        "async"  # "async": sampler and trainer overlap, η = max_staleness; "sync": the baseline (η 0).
    )
    c.max_staleness = 2  # η: admission runs at most η policy versions ahead of training (AReaL's rule).
    c.max_head_staleness = -1  # Drop groups whose head staleness exceeds this when trained; -1 = off.
    c.total_steps = 100  # Train steps (= policy versions) to run.
    c.prompts_per_step = 16  # B: prompts per train batch.
    c.samples_per_prompt = 8  # Group size: completions per prompt (one shared prefill).
    c.tokenizer = ""  # "char" (built-in), an HF tokenizer directory, or "" = the model checkpoint's.
    c.eval_every = (
        10  # Train steps between greedy pass@1 evaluations on held-out prompts; 0 = only at the end.
    )
    c.eval_prompts = 200  # Held-out prompts per evaluation.
    # Slots of the greedy eval engine (rounded down to a multiple of mesh.sampler's data axis, at most the
    # sampler's): its KV cache sits beside the sampler's on the same devices, slots x slot length.
    c.eval_slots = 64
    # "own": the eval engine holds its own copy of the weights, so an evaluation decodes every token with
    # the version it evaluates while sampling moves on (one more weight copy per sampler device). "shared":
    # it shares the sampler's weights (no copy; for models whose second copy would not fit): new versions
    # reach a running evaluation too, the log names the versions it spanned, and versions due while
    # another evaluation runs are skipped (logged), except the last one.
    c.eval_weights = "own"
    c.log_every = 1  # Train steps between TensorBoard writes and summary lines.
    c.text_samples = 4  # Completions (with rewards) written to TensorBoard as text at each log step.
    c.checkpoint_every = 50  # Train steps between orbax checkpoints (0 = by time only); always at the end.
    c.checkpoint_minutes = 30.0  # Also checkpoint when this many minutes passed since the last; 0 = off.
    c.checkpoint_keep = 3  # Newest checkpoints kept (plus the one with the best held-out accuracy).
    # Checksum the sampler's weights after every sync against the trainer's (a host read: for tests).
    c.verify_weights = False
    # Benchmarks: per-prompt generation caps "lognormal:median=24,p99=96,max=128,seed=1"; "" = off.
    c.length_caps = ""
    # JAX's persistent compilation cache: a directory of your own (e.g. "~/.cache/jaxrl_async/xla"), so a
    # rerun, restart or resume with the same shapes loads its compiled programs instead of compiling them
    # (jaxrl_async/runtime/compile_cache.py); "" = off. Refused if others may write to it: JAX runs what it
    # loads from there.
    c.compile_cache_dir = ""
    # Record the decisions timing makes (decode calls, versions applied, rewards, environments' answers,
    # each step's groups) in workdir/schedule/, so `jaxrl-run --replay=WORKDIR` reruns the run bit for bit
    # (docs/reproducibility.md): "auto" = on for async runs (a sync run is already reproducible from its
    # seeds, unless its environments are not deterministic: "on" records those), "on", "off". On by
    # default because it is cheap: ~17 KB and < 0.1% of a step's time per step on letter_range
    # (benchmarks/bench_schedule_log.py; docs/reproducibility.md).
    c.record_schedule = "auto"

    # Which model and numerics (jaxrl_async.run_config.ModelSection documents each field).
    c.model = dataclass_section(ModelSection)
    # How the devices split between sampler and trainer (jaxrl_async.run_config.MeshConfig).
    c.mesh = dataclass_section(MeshConfig)

    c.data = dataclass_section(DataConfig)
    # reward.reward: "" = the data task's reward (run_config.TASK_REWARD); a row's metadata may name its own.
    c.reward = dataclass_section(RewardConfig, reward="")
    c.sampler = dataclass_section(SamplerConfig)  # update_mode: keep_kv | recompute_kv | finish.
    # trainer.total_steps: the learning-rate schedule's length; 0 = config.total_steps. trainer.temperature
    # is not set here: it is the sampler's (config.sampler.temperature).
    c.trainer = dataclass_section(TrainConfig, total_steps=0)
    c.warm_start = dataclass_section(WarmStartConfig, enabled=False)
    # Multi-turn episodes with tool calls (jaxrl_async.envs.EnvConfig; docs/environments.md): off = one
    # completion per sample, as every run before; env.enabled=True runs each sample as an episode.
    c.env = dataclass_section(EnvConfig)
    return c
