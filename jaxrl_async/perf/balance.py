"""A config's sampler/trainer balance and its evaluation's cost, predicted from measured step times.

Decode: a step streams the sampler's weights and every live sequence's KV cache, so its roofline is
bytes / HBM bandwidth; what a real step reaches of it was measured on one H200 (docs/history/benchmarks.md,
"First run on an H200", Qwen3-8B shape, bf16, paged kernel, 16 steps a call): 64% at batch 1 x 1k
context, 30% at 64 x 1k, 50% at 1 x 8k, 22% at 64 x 8k. `decode_step_s` takes that fraction at the
point's (batch, context), interpolated in log(batch) and context and held at the edges, and applies it to
the target's roofline, so a GPU with less bandwidth or a smaller model is scaled, not re-measured.
Train: 6 x parameters FLOPs a trained token (+ 2 for the pi_prox forward of decoupled PPO with several
minibatches) at the MFU measured there (35%, Qwen2.5-1.5B, 2 x 4k-token rows, bf16).

The predictions are as good as those four points: before the paged kernel's blocks were fixed (same
section), and on one GPU. They size a layout's balance and tell an hour-long evaluation from a minute's;
they do not replace a device check.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_async.model import ModelConfig
from jaxrl_async.perf.hardware import Hardware
from jaxrl_async.perf.workload import LogNormalLengths

# (batch, context) -> fraction of the HBM roofline, measured on an H200 (module doc).
MEASURED_DECODE_FRACTION = {(1, 1024): 0.64, (64, 1024): 0.30, (1, 8192): 0.50, (64, 8192): 0.22}
MEASURED_TRAIN_MFU = 0.35


def decode_fraction(batch: float, context: float) -> float:
    """The measured fraction of the roofline at (batch, context), bilinear in (log2 batch, context),
    clamped to the measured range."""
    u = float(np.clip(np.log2(max(batch, 1)) / 6.0, 0.0, 1.0))  # 1 -> 0, 64 -> 1
    v = float(np.clip((context - 1024) / (8192 - 1024), 0.0, 1.0))
    f = MEASURED_DECODE_FRACTION
    low = (1 - u) * f[(1, 1024)] + u * f[(64, 1024)]
    high = (1 - u) * f[(1, 8192)] + u * f[(64, 8192)]
    return (1 - v) * low + v * high


def _per_device(model: ModelConfig, tensor: int) -> tuple[float, float]:
    """(weight bytes, KV bytes a position) on one sampler device, bf16, heads split over `tensor`."""
    itemsize = 2
    kv_heads = model.n_kv_heads // tensor if model.n_kv_heads % tensor == 0 else model.n_kv_heads
    return model.num_params * itemsize / tensor, 2 * model.n_layers * kv_heads * model.head_dim * itemsize


def decode_step_s(model: ModelConfig, hw: Hardware, batch: float, context: float, tensor: int = 1) -> float:
    """Seconds of one decode step of `batch` sequences at `context` positions on a device of `hw`."""
    weights, kv = _per_device(model, tensor)
    return (weights + batch * context * kv) / hw.mem_bw / decode_fraction(batch, context)


def train_step_s(model: ModelConfig, hw: Hardware, tokens: float, devices: int, prox: bool) -> float:
    """Seconds of one train step over `tokens` on `devices` at the measured MFU."""
    flops = (6 + 2 * prox) * model.num_params * tokens
    return flops / (devices * hw.peak_flops * MEASURED_TRAIN_MFU)


@dataclasses.dataclass(frozen=True)
class Balance:
    """Per train step: the sampler's and the trainer's seconds, and one evaluation's cost.

    Attributes:
      mean_len: mean response tokens (the lognormal capped at max_new_tokens).
      decode_batch: sequences a sampler device decodes at once (its slots, kept full).
      sampler_s: seconds the sampler needs for one step's prompts x samples at its decode batch.
      trainer_s: seconds of one train step.
      eval_s: seconds of one evaluation's decode (eval prompts at the eval engine's batch).
      eval_worst_s: the same if every completion runs to max_new_tokens (an untrained model may not stop).
      eval_sampling_loss: the share of the whole sampler's device time an evaluation takes while it runs
        (the evaluating replica alternates a sampler `generate` call and an eval one on the same devices;
        the other replicas sample on).
    """

    mean_len: float
    decode_batch: float
    sampler_s: float
    trainer_s: float
    eval_s: float
    eval_worst_s: float
    eval_sampling_loss: float

    @property
    def bound(self) -> str:
        return "sampler" if self.sampler_s > self.trainer_s else "trainer"

    @property
    def step_s(self) -> float:
        """A train step's period: the slower role's time."""
        return max(self.sampler_s, self.trainer_s)

    @property
    def eval_train_steps(self) -> float:
        """One evaluation (at the mean length) in train steps."""
        return self.eval_s / self.step_s


def predict(config, model: ModelConfig, hw: Hardware, sampler_cfg, train_cfg, median_len: float,
            p99_len: float, prompt_len: float, eval_slots: int,
            decode_batch: float | None = None) -> Balance:  # fmt: skip
    """The balance of a run config (`config`: mesh, prompts_per_step, samples_per_prompt, eval_prompts).

    Args:
      decode_batch: sequences a sampler device decodes at once (default its slots, num_slots / data; a
        paged cache may hold fewer, `runtime.plan_check.paged_kv_plan`).
    """
    data, tensor = config.mesh.sampler
    replicas = max(int(config.mesh.get("sampler_replicas", 0) or 0), 1)
    n_max = sampler_cfg.max_new_tokens
    lengths = LogNormalLengths(median_len, p99_len, max_len=n_max).sample(np.random.default_rng(0), 20000)
    mean_len = float(np.mean(np.minimum(lengths, n_max)))
    context = prompt_len + mean_len / 2  # a live sequence's mean position
    batch = decode_batch or sampler_cfg.num_slots / data  # per device: the sampler keeps its slots full
    step = decode_step_s(model, hw, batch, context, tensor)
    samples = config.prompts_per_step * config.samples_per_prompt
    sequences_per_s = replicas * data * batch / (mean_len * step)
    sampler_s = samples / sequences_per_s
    nt = config.mesh.trainer[0] * config.mesh.trainer[1]
    prox = train_cfg.minibatches > 1 and train_cfg.prox_mode == "recompute"
    trainer_s = train_step_s(model, hw, samples * (prompt_len + mean_len), nt, prox)
    eval_batch = max(1, eval_slots // data)  # per device of the evaluating replica
    eval_step = decode_step_s(model, hw, eval_batch, context, tensor)
    # The eval loop refills its slots as completions finish: its steps are its tokens over its slots.
    per_slot = config.eval_prompts / (eval_batch * data)
    eval_s = per_slot * mean_len * eval_step
    eval_worst_s = per_slot * n_max * decode_step_s(model, hw, eval_batch, prompt_len + n_max / 2, tensor)
    loss = eval_step / (eval_step + step) / replicas
    return Balance(mean_len, batch, sampler_s, trainer_s, eval_s, eval_worst_s, loss)


def report_lines(bal, max_eval_steps: float) -> str:
    """The plan check's lines: the predicted balance and the first evaluation's cost, and a warning when
    one evaluation costs more than `max_eval_steps` train steps (a module of its own, not the command's,
    so a test imports it without the command's flags)."""
    ratio = max(bal.sampler_s, bal.trainer_s) / min(bal.sampler_s, bal.trainer_s)
    lines = [
        f"  balance (perf.balance: the H200's measured decode fractions and MFU, scaled to this hardware; "
        f"mean response {bal.mean_len:.0f} tokens): decode batch {bal.decode_batch:.1f} per sampler device; "
        f"sampler {bal.sampler_s:.0f} s a step, trainer {bal.trainer_s:.0f} s a step -> {bal.bound}-bound "
        f"by {ratio:.1f}x",
        f"  first evaluation: {bal.eval_s / 60:.1f} min at the mean length ({bal.eval_train_steps:.1f} train "
        f"steps of {bal.step_s:.0f} s), {bal.eval_worst_s / 60:.1f} min if every completion runs to "
        f"max_new_tokens; it takes {bal.eval_sampling_loss:.0%} of the sampler's device time while it runs",
    ]
    if bal.eval_train_steps > max_eval_steps:
        lines.append(
            f"  warning: one evaluation may cost {bal.eval_train_steps:.1f} train steps, over "
            f"--max-eval-steps={max_eval_steps:g}; lower config.eval_prompts, raise config.eval_slots, or "
            "evaluate less often (config.eval_every)"
        )
    return "\n".join(lines)
