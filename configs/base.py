"""Defaults shared by every run; configs/*.py import this and override.

Component sections (data, reward, sampler, trainer, warm_start) are built from the components' own
frozen dataclasses, whose docstrings document each field: jaxrl_async.data.DataConfig,
jaxrl_async.rewards.RewardConfig, jaxrl_async.sampler.SamplerConfig, jaxrl_async.trainer.TrainConfig,
jaxrl_async.warmstart.WarmStartConfig. Override any field with --config.<section>.<field>=value.
"""

import ml_collections

from jaxrl_async.data import DataConfig
from jaxrl_async.rewards import RewardConfig
from jaxrl_async.run_config import dataclass_section
from jaxrl_async.sampler import SamplerConfig
from jaxrl_async.trainer import TrainConfig
from jaxrl_async.warmstart import WarmStartConfig


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.workdir = ""  # Where TensorBoard events (workdir/tb), checkpoints and the run log go. Required.
    c.seed = 0  # Seeds parameter init, data order and sampling.
    c.mode = (
        "async"  # "async": sampler and trainer overlap, eta = max_staleness; "sync": the baseline (eta 0).
    )
    c.max_staleness = 2  # eta: admission runs at most eta policy versions ahead of training (AReaL's rule).
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
    c.log_every = 1  # Train steps between TensorBoard writes and summary lines.
    c.text_samples = 4  # Completions (with rewards) written to TensorBoard as text at each log step.
    c.checkpoint_every = 50  # Train steps between orbax checkpoints (0 = by time only); always at the end.
    c.checkpoint_minutes = 30.0  # Also checkpoint when this many minutes passed since the last; 0 = off.
    c.checkpoint_keep = 3  # Newest checkpoints kept (plus the one with the best held-out accuracy).
    # Checksum the sampler's weights after every sync against the trainer's (a host read: for tests).
    c.verify_weights = False
    # Benchmarks: per-prompt generation caps "lognormal:median=24,p99=96,max=128,seed=1"; "" = off.
    c.length_caps = ""

    c.model = ml_collections.ConfigDict()
    c.model.preset = "tiny"  # Shape preset (jaxrl_async.model.presets) when no checkpoint is given.
    c.model.checkpoint = ""  # Local HF checkpoint directory; overrides the preset's shape.
    c.model.dtype = "float32"  # Compute dtype (activations, matmuls, sampler weights): float32 | bfloat16.
    # Storage dtype of the trainer's master weights and optimizer state: float32 | bfloat16. Keep float32:
    # at lr 1e-6 an AdamW step is below half a bf16 ulp of most weights, so bf16 masters do not move.
    c.model.param_dtype = "float32"
    # Training and prefill attention: "auto" (cuDNN flash via jax.nn.dot_product_attention on GPU, the
    # splash Pallas kernel on TPU, "reference" on CPU) | "reference" | "dot_product" | "splash".
    c.model.attention = "auto"
    c.model.vocab_size = 0  # Preset override; 0 = the tokenizer's vocabulary size (rounded up to 8).
    c.model.n_layers = 0  # Preset override; 0 = the preset's layer count.

    c.mesh = ml_collections.ConfigDict()
    c.mesh.sampler = (4, 1)  # Sampler submesh (data, tensor); takes the first devices.
    c.mesh.trainer = (4, 1)  # Trainer submesh (fsdp, tensor); takes the devices after the sampler's.
    c.mesh.fake_cpu_devices = 8  # On a CPU-only machine, create this many fake devices.
    # Sampler and trainer share the first devices (one GPU): the two roles then take turns on them.
    c.mesh.colocate = False
    # Several processes (launch/local_cluster.py, a TPU pod, SLURM): which process ids sample (one sampler
    # replica of `mesh.sampler` each) and which train (one trainer mesh over their devices; the first is
    # the learner lead). () and () = this one process does both.
    c.mesh.sampler_processes = ()
    c.mesh.trainer_processes = ()

    c.data = dataclass_section(DataConfig)
    # reward.reward: "" = the data task's reward (run_config.TASK_REWARD); a row's metadata may name its own.
    c.reward = dataclass_section(RewardConfig, reward="")
    c.sampler = dataclass_section(SamplerConfig)  # update_mode: keep_kv | recompute_kv | finish.
    # trainer.total_steps: the learning-rate schedule's length; 0 = config.total_steps. trainer.temperature
    # is not set here: it is the sampler's (config.sampler.temperature).
    c.trainer = dataclass_section(TrainConfig, total_steps=0)
    c.warm_start = dataclass_section(WarmStartConfig, enabled=False)
    return c
