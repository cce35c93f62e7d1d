"""TrainConfig: everything the trainer's step needs besides the model, validated on construction."""

from __future__ import annotations

import dataclasses

from jaxrl_async.model.lora import LoraConfig
from jaxrl_async.trainer.advantages import ADVANTAGES, KL_ESTIMATORS
from jaxrl_async.trainer.losses import LOSSES, LossHParams, reads_prox

PROX_MODES = ("recompute", "loglinear")
_LOSS = LossHParams()  # the loss fields' defaults (declared once, in losses.py)

# The loss hyper-parameters each loss reads (besides aggregation, constant and offpolicy_seq_mask, which
# every loss reads). A value other than the default on a field the chosen loss never reads is refused:
# it would silently do nothing.
_BEHAV = ("behav_mode", "behav_level", "behav_cap", "behav_floor")
LOSS_READS = {
    "decoupled_ppo": ("eps_low", "eps_high", "dual_clip", *_BEHAV),
    "gspo": ("eps_low", "eps_high", "dual_clip", *_BEHAV),
    "ppo": ("eps_low", "eps_high", "dual_clip"),  # pi_prox = pi_behav: the behaviour weight is 1
    "reinforce_tis": ("eps_high",),
    "m2po": ("m2po_tau",),
}
_EVERY_LOSS = ("aggregation", "constant", "offpolicy_seq_mask")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Trainer hyper-parameters (frozen and hashable: it keys the compiled step).

    Attributes:
      loss: policy loss kind (losses.LOSSES).
      eps_low, eps_high, dual_clip, behav_mode, behav_level, behav_cap, behav_floor, aggregation,
        constant, m2po_tau, offpolicy_seq_mask: the loss hyper-parameters, with losses.LossHParams's
        defaults and meaning. Setting one that the chosen loss never reads is an error (LOSS_READS).
      advantage: advantage estimator (advantages.ADVANTAGES).
      lr, warmup_steps, total_steps, end_lr_ratio: linear warmup from 0 to `lr`, then cosine decay to
        `lr * end_lr_ratio` at `total_steps`, both counted in train steps (versions), whatever the
        number of optimizer updates a step makes.
      b1, b2, adam_eps, weight_decay: AdamW (decay skips norms, biases and other vectors).
      clip_norm: global gradient-norm clip; None = off.
      token_budget: positions per packed row; rows_per_micro: rows per micro-batch (a multiple of the
        mesh's fsdp size). One micro-batch holds rows_per_micro * token_budget positions.
      logits_chunk: the unembedding and logprobs run this many positions of a row at a time, so only
        one chunk's float32 logits exist at once (a 32k-position row of a 152k vocabulary would hold
        20 GB); rows up to this long are done in one piece. Longer rows must be a multiple of it.
      minibatches: M, exactly the optimizer updates per train step: the batch's groups are split into M
        disjoint, seeded-shuffled, token-balanced shares, each packed into micro-batches of its own
        (prepare_batch); a batch of fewer than M groups is an error. The default, 4, is AReaL's
        ppo_n_minibatches: with 1, pi_prox equals pi_theta at the only update and decoupled PPO's clip
        never binds (no trust region).
      minibatch_seed: seeds the split (with the batch's group ids, so every trainer process and every
        paired run splits a batch alike).
      ess_scaled_step: scale each update by the effective-sample-size fraction of rho = pi_theta /
        pi_behav over its tokens (the applied AdamW step shrinks; the moments see the full gradient).
      controlled_lag: k > 0 makes every sampler run on the weights of version v - k while the trainer
        is at v (runtime/lag.py): with mode=sync every token of step v >= k is exactly k stale, so
        timing and admission no longer decide the staleness. 0 = off. Read by the runtime.
      prox_mode: "recompute" (pi_prox from the weights at the start of the step: a forward pass when
        minibatches > 1, the stop-gradient of the loss's own forward when minibatches == 1, which is the
        same number) or "loglinear" (AReaL's version interpolation, no forward pass).
      compute_dtype: activations/matmul dtype ("float32", "bfloat16"); None = the model config's. The
        parameters (master weights) and optimizer state keep the model's param_dtype.
      temperature: sampling temperature; trainer logprobs use the same one as the sampler.
      kl_coef, kl_estimator: KL penalty to the reference parameters (0 = off, no reference forward).
      remat: rematerialize layers in the backward pass.
      unroll_layers: run the layers unrolled instead of as one `lax.scan` (same math). The scan keeps
        compile time flat in depth; unrolled, XLA:CPU saves the scan's stacked residuals and their
        dynamic slices: the tiny 3-layer model's train micro-batch (64 x 72 rows, idle 2-core Intel Xeon)
        took 0.235 s unrolled against 0.29 s scanned. For shallow models on CPU; deep models keep the scan.
      staleness_bins: size of the per-token staleness histogram (last bin = that many or more).
      skip_zero_advantage: leave sequences whose advantage is 0 (groups whose rewards are all equal)
        out of the packed batch. Their policy-gradient term is 0, so only the token-mean's denominator
        changes; the step then costs compute in proportion to the informative samples (DAPO's filter,
        without resampling). Needs kl_coef == 0 (the KL term has a gradient on every sample).
      dynamic_sampling: DAPO's dynamic sampling: groups whose rewards are all equal are discarded as they
        finish and new prompts are sampled in their place until the batch holds prompts_per_step
        informative groups. Discarded groups return their admission budget, so max_staleness still bounds the
        staleness of every trained group. The learner applies it; the step itself is unchanged.
      dynamic_sampling_patience: batches' worth of consecutive discarded groups after which the run
        saves and stops (nothing left to learn on this data).
      lora: low-rank adapters (model.lora.LoraConfig); lora.enabled=False (the default) is full
        fine-tuning, unchanged. A dict (a config file's section) is read as a LoraConfig.
    """

    loss: str = "decoupled_ppo"
    eps_low: float = _LOSS.eps_low
    eps_high: float = _LOSS.eps_high
    dual_clip: float | None = _LOSS.dual_clip
    behav_mode: str = _LOSS.behav_mode
    behav_level: str = _LOSS.behav_level
    behav_cap: float = _LOSS.behav_cap
    behav_floor: float = _LOSS.behav_floor
    aggregation: str = _LOSS.aggregation
    constant: float = _LOSS.constant
    m2po_tau: float = _LOSS.m2po_tau
    offpolicy_seq_mask: float | None = _LOSS.offpolicy_seq_mask
    advantage: str = "grpo"
    lr: float = 1e-6
    warmup_steps: int = 0
    total_steps: int = 1000
    end_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float | None = 1.0
    token_budget: int = 1024
    rows_per_micro: int = 1
    logits_chunk: int = 4096
    minibatches: int = 4
    minibatch_seed: int = 0
    ess_scaled_step: bool = False
    controlled_lag: int = 0
    prox_mode: str = "recompute"
    compute_dtype: str | None = None
    temperature: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    remat: bool = False
    unroll_layers: bool = False
    staleness_bins: int = 16
    skip_zero_advantage: bool = False
    dynamic_sampling: bool = False
    dynamic_sampling_patience: int = 20
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)

    def __post_init__(self):
        if isinstance(self.lora, dict):  # config.trainer.lora from a config file or the command line
            known = {f.name for f in dataclasses.fields(LoraConfig)}
            unknown = sorted(set(self.lora) - known)
            if unknown:
                raise ValueError(f"config.trainer.lora.{unknown[0]}: unknown field (known: {sorted(known)})")
            object.__setattr__(self, "lora", LoraConfig(**self.lora))
        if self.loss not in LOSSES:
            raise ValueError(f"TrainConfig.loss={self.loss!r} not in {sorted(LOSSES)}")
        self.loss_hparams()  # validates the loss hyper-parameters
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"TrainConfig.advantage={self.advantage!r} not in {sorted(ADVANTAGES)}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"TrainConfig.kl_estimator={self.kl_estimator!r} not in {sorted(KL_ESTIMATORS)}")
        if self.prox_mode not in PROX_MODES:
            raise ValueError(f"TrainConfig.prox_mode={self.prox_mode!r} not in {PROX_MODES}")
        if self.compute_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(
                f"TrainConfig.compute_dtype={self.compute_dtype!r} not in (None, float32, bfloat16)"
            )
        if self.lr < 0 or self.weight_decay < 0 or self.kl_coef < 0:
            raise ValueError("TrainConfig: lr, weight_decay and kl_coef must be >= 0")
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(
                f"TrainConfig: need 0 <= warmup_steps < total_steps, got {self.warmup_steps}, "
                f"{self.total_steps}"
            )
        if not 0 <= self.end_lr_ratio <= 1:
            raise ValueError(f"TrainConfig.end_lr_ratio must be in [0, 1], got {self.end_lr_ratio}")
        if self.clip_norm is not None and self.clip_norm <= 0:
            raise ValueError(f"TrainConfig.clip_norm must be > 0 or None, got {self.clip_norm}")
        for name in ("token_budget", "rows_per_micro", "logits_chunk", "minibatches", "staleness_bins",
                     "dynamic_sampling_patience"):  # fmt: skip
            if int(getattr(self, name)) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.token_budget > self.logits_chunk and self.token_budget % self.logits_chunk:
            raise ValueError(
                f"TrainConfig.logits_chunk={self.logits_chunk} must divide token_budget={self.token_budget} "
                "(or be >= it)"
            )
        if self.skip_zero_advantage and self.kl_coef > 0:
            raise ValueError("TrainConfig.skip_zero_advantage needs kl_coef == 0 (the KL term has gradients)")
        if self.temperature <= 0:
            raise ValueError(f"TrainConfig.temperature must be > 0, got {self.temperature}")
        if int(self.controlled_lag) < 0:
            raise ValueError(f"TrainConfig.controlled_lag must be >= 0, got {self.controlled_lag}")
        self._refuse_unread()

    def _refuse_unread(self) -> None:
        """A knob set away from its default that this configuration never reads is an error."""
        names = [f.name for f in dataclasses.fields(LossHParams)]
        reads = set(LOSS_READS.get(self.loss, names)) | set(_EVERY_LOSS)  # a loss added elsewhere: all
        if "behav_mode" in reads:
            if self.behav_mode == "none":
                reads -= {"behav_level", "behav_cap", "behav_floor"}
            elif self.behav_mode == "truncate":
                reads -= {"behav_floor"}
        if self.aggregation != "constant":
            reads.discard("constant")
        for f in dataclasses.fields(LossHParams):
            if f.name not in reads and getattr(self, f.name) != f.default:
                raise ValueError(
                    f"TrainConfig.{f.name}={getattr(self, f.name)!r} has no effect with loss={self.loss!r}, "
                    f"behav_mode={self.behav_mode!r}, aggregation={self.aggregation!r}"
                )
        if self.prox_mode != "recompute" and not reads_prox(self.loss):
            raise ValueError(
                f"TrainConfig.prox_mode={self.prox_mode!r} has no effect: loss={self.loss!r} has no pi_prox"
            )
        default = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        patience = self.dynamic_sampling_patience
        if patience != default["dynamic_sampling_patience"] and not self.dynamic_sampling:
            raise ValueError("TrainConfig.dynamic_sampling_patience has no effect without dynamic_sampling")
        if self.kl_estimator != default["kl_estimator"] and self.kl_coef == 0:
            raise ValueError("TrainConfig.kl_estimator has no effect with kl_coef == 0")

    def loss_hparams(self) -> dict:
        """The keyword arguments of `losses.policy_loss` (validated)."""
        names = [f.name for f in dataclasses.fields(LossHParams)]
        hp = {n: getattr(self, n) for n in names}
        LossHParams(**hp)
        return hp
