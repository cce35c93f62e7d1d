"""Policy-gradient losses as small registered pure functions over [B, T] token arrays.

Every loss returns a (sum, count) pair: the objective to minimise is `sum / count`, and because both parts
add across micro-batches (a sequence never spans two micro-batches), accumulating sums and counts over any
split of a batch gives exactly the loss of the whole batch. `count` never depends on the parameters, so
the gradient of the whole batch is (sum of micro-batch gradients of `sum`) / (sum of counts).

Aggregations (what `sum` and `count` hold):
  token_mean (DAPO): sum over tokens of the token loss; count = number of loss tokens.
  seq_mean: sum over sequences of each sequence's token-mean loss; count = number of sequences.
  constant (Dr.GRPO): sum over tokens divided by `constant` (e.g. the maximum completion length);
    count = number of sequences, so the loss is (1 / G) * sum_i sum_t loss_it / constant.
A "sequence" is a (row, segment id) pair when `segment_ids` is given (packed rows), else a row; only
sequences with at least one loss token count.

Metrics are returned as a dict of float32 scalars: keys ending in `_max` combine across micro-batches
with max, all others with +; `finalize_metrics` turns the sums into means.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

LOSS_KINDS = ("decoupled_ppo", "ppo", "gspo", "reinforce_tis", "m2po")
BEHAV_MODES = ("none", "truncate", "mask")
BEHAV_LEVELS = ("token", "sequence")
AGGREGATIONS = ("token_mean", "seq_mean", "constant")


@dataclasses.dataclass(frozen=True)
class LossHParams:
    """Hyper-parameters shared by the policy losses; the one place their defaults are declared
    (TrainConfig's loss fields take theirs from here).

    Attributes:
      eps_low, eps_high: the ratio u = pi_theta / pi_prox is clipped to [1 - eps_low, 1 + eps_high]
        (clip-higher when eps_high > eps_low). reinforce_tis truncates its weight at 1 + eps_high.
      dual_clip: c > 1 bounds the loss of negative-advantage tokens at -c * A; None = off. On (3) by
        default: it never binds near the proximal policy (u < c) and caps what one very stale token with
        A < 0 can do, which is where off-policy updates blow up (AReaL's c_clip, off there by default).
      behav_mode: how the behaviour weight w = pi_prox / pi_behav enters: "none" (w = 1), "truncate"
        (TIS: w = min(w, behav_cap)) or "mask" (w = 0 outside [behav_floor, behav_cap]: AReaL's
        default, which drops the most-drifted tokens instead of giving them the largest weight).
      behav_level: "token" (per-token w) or "sequence" (one w per sequence: the geometric mean of its
        token weights, so sequences of different lengths stay comparable).
      behav_cap, behav_floor: bounds for truncate / mask.
      aggregation: "token_mean", "seq_mean" or "constant" (see the module docstring).
      constant: the Dr.GRPO normalizer for aggregation="constant".
      m2po_tau: M2PO's bound on the second moment of log(pi_theta / pi_behav) (loss="m2po").
      offpolicy_seq_mask: delta > 0 drops every sequence with A < 0 whose mean log(pi_behav / pi_theta)
        over its tokens exceeds delta (a stale sequence the policy has already moved away from: pushing
        it down further only adds variance); None = off. Any loss.
    """

    eps_low: float = 0.2
    eps_high: float = 0.28  # DAPO's clip-higher
    dual_clip: float | None = 3.0
    behav_mode: str = "mask"
    behav_level: str = "token"
    behav_cap: float = 5.0
    behav_floor: float = 0.0
    aggregation: str = "token_mean"
    constant: float = 1.0
    m2po_tau: float = 0.04
    offpolicy_seq_mask: float | None = None

    def __post_init__(self):
        if not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 or None, got {self.dual_clip}")
        if self.behav_mode not in BEHAV_MODES:
            raise ValueError(f"behav_mode={self.behav_mode!r} not in {BEHAV_MODES}")
        if self.behav_level not in BEHAV_LEVELS:
            raise ValueError(f"behav_level={self.behav_level!r} not in {BEHAV_LEVELS}")
        if not 0 <= self.behav_floor < self.behav_cap:
            raise ValueError(f"need 0 <= behav_floor < behav_cap, got {self.behav_floor}, {self.behav_cap}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation={self.aggregation!r} not in {AGGREGATIONS}")
        if self.constant <= 0:
            raise ValueError(f"constant must be > 0, got {self.constant}")
        if self.m2po_tau <= 0:
            raise ValueError(f"m2po_tau must be > 0, got {self.m2po_tau}")
        if self.offpolicy_seq_mask is not None and self.offpolicy_seq_mask <= 0:
            raise ValueError(f"offpolicy_seq_mask must be > 0 or None, got {self.offpolicy_seq_mask}")


@dataclasses.dataclass(frozen=True)
class Segments:
    """Per-sequence reductions over [B, T] arrays whose rows hold segments 1..T (0 = padding)."""

    seg_BxT: jax.Array
    mask_BxT: jax.Array

    @classmethod
    def make(cls, mask_BxT, segment_ids_BxT=None) -> Segments:
        mask_BxT = mask_BxT.astype(jnp.float32)
        if segment_ids_BxT is None:
            segment_ids_BxT = jnp.ones(mask_BxT.shape, jnp.int32)
        return cls(segment_ids_BxT.astype(jnp.int32), mask_BxT)

    def sums(self, x_BxT) -> jax.Array:
        """Masked per-segment sums [B, T + 1] (index = segment id)."""
        num = self.seg_BxT.shape[1] + 1
        row_sum = lambda x, s: jax.ops.segment_sum(x, s, num_segments=num)
        return jax.vmap(row_sum)(x_BxT * self.mask_BxT, self.seg_BxT)

    def broadcast(self, per_seg_BxS) -> jax.Array:
        """Each token's value of a per-segment quantity [B, T + 1]."""
        return jnp.take_along_axis(per_seg_BxS, self.seg_BxT, axis=1)

    def lengths(self) -> jax.Array:
        """Loss tokens per segment [B, T + 1]."""
        return self.sums(jnp.ones_like(self.mask_BxT))

    def token_mean(self, x_BxT) -> jax.Array:
        """Each token's masked mean of `x` over its own sequence [B, T]."""
        return self.broadcast(self.sums(x_BxT) / jnp.maximum(self.lengths(), 1.0))

    def num_sequences(self) -> jax.Array:
        return jnp.sum(self.lengths() > 0).astype(jnp.float32)


def aggregate(loss_BxT, segs: Segments, hp: LossHParams) -> tuple[jax.Array, jax.Array]:
    """(sum, count) of a per-token loss under `hp.aggregation`."""
    mask = segs.mask_BxT
    if hp.aggregation == "token_mean":
        return jnp.sum(loss_BxT * mask), jnp.sum(mask)
    if hp.aggregation == "seq_mean":
        per_seq = segs.sums(loss_BxT) / jnp.maximum(segs.lengths(), 1.0)
        return jnp.sum(per_seq), segs.num_sequences()
    return jnp.sum(loss_BxT * mask) / hp.constant, segs.num_sequences()


def behaviour_weight(prox_BxT, behav_BxT, segs: Segments, hp: LossHParams):
    """(w applied to the loss, raw w, 0/1 "truncated or masked") per token, all without gradient."""
    log_w = jax.lax.stop_gradient(prox_BxT - behav_BxT) * segs.mask_BxT
    if hp.behav_level == "sequence":
        log_w = segs.token_mean(log_w)
    raw_w = jnp.exp(jnp.clip(log_w, -30.0, 30.0))
    if hp.behav_mode == "none":
        return jnp.ones_like(raw_w), raw_w, jnp.zeros_like(raw_w)
    if hp.behav_mode == "truncate":
        hit = raw_w > hp.behav_cap
        return jnp.minimum(raw_w, hp.behav_cap), raw_w, hit.astype(jnp.float32)
    keep = (raw_w <= hp.behav_cap) & (raw_w >= hp.behav_floor)
    return jnp.where(keep, raw_w, 0.0), raw_w, (~keep).astype(jnp.float32)


def _clipped_objective(ratio_BxT, adv_BxT, hp: LossHParams):
    """Per-token PPO loss -min(u A, clip(u) A) with optional dual clip; also the clip indicators.

    The clip binds (the token has no gradient) at u > 1 + eps_high when A > 0 ("high") and at
    u < 1 - eps_low when A < 0 ("low"); the dual clip bounds A < 0 tokens whose u is very large."""
    clipped_ratio = jnp.clip(ratio_BxT, 1.0 - hp.eps_low, 1.0 + hp.eps_high)
    obj_unclipped, obj_clipped = ratio_BxT * adv_BxT, clipped_ratio * adv_BxT
    loss = -jnp.minimum(obj_unclipped, obj_clipped)
    clip_hit = obj_clipped < obj_unclipped
    dual_hit = jnp.zeros_like(clip_hit)
    if hp.dual_clip is not None:
        bound = -hp.dual_clip * adv_BxT
        dual_hit = (adv_BxT < 0) & (loss > bound)
        loss = jnp.where(dual_hit, bound, loss)
    f32 = lambda x: x.astype(jnp.float32)
    return loss, {
        "clip_low": f32(clip_hit & (adv_BxT < 0)),
        "clip_high": f32(clip_hit & (adv_BxT > 0)),
        "dual_clip": f32(dual_hit),
    }


LossFn = Callable[..., tuple[jax.Array, dict]]
LOSSES: dict[str, LossFn] = {}
# The per-token stats every loss returns ([B, T] each): ratio clipped below (A < 0) and above (A > 0),
# dual clip hit, behaviour weight, token truncated or masked by the behaviour weight. The trainer's
# metrics are built from exactly these.
LOSS_STATS = ("clip_low", "clip_high", "dual_clip", "is_weight", "behav_dropped")


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """What the trainer needs to know about a registered loss besides its function.

    Attributes:
      reads_prox: whether the loss uses pi_prox. False (PPO against the behaviour policy, REINFORCE with
        truncated IS): the trainer passes the behaviour logprobs and never computes pi_prox.
    """

    reads_prox: bool = True


LOSS_SPECS: dict[str, LossSpec] = {}


def register_loss(name: str, reads_prox: bool = True):
    """Adds a per-token loss `fn(logp, prox, behav, adv, segs, hp) -> (loss_BxT, stats)` to LOSSES, with
    `stats` holding exactly LOSS_STATS, and its LossSpec to LOSS_SPECS."""

    def wrap(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} registered twice")
        LOSSES[name] = fn
        LOSS_SPECS[name] = LossSpec(reads_prox=reads_prox)
        return fn

    return wrap


def reads_prox(kind: str) -> bool:
    """Whether the registered loss `kind` uses pi_prox (see LossSpec)."""
    return LOSS_SPECS[kind].reads_prox


def _ppo_family(log_ratio_BxT, prox, behav, adv, segs, hp):
    ratio = jnp.exp(jnp.clip(log_ratio_BxT, -30.0, 30.0))
    pg, clip_stats = _clipped_objective(ratio, adv, hp)
    w, raw_w, dropped = behaviour_weight(prox, behav, segs, hp)
    return w * pg, {**clip_stats, "is_weight": raw_w, "behav_dropped": dropped}


@register_loss("decoupled_ppo")
def decoupled_ppo(logp, prox, behav, adv, segs, hp):
    """AReaL's decoupled PPO: w * -min(u A, clip(u) A), u = pi_theta / pi_prox, w = pi_prox / pi_behav."""
    return _ppo_family((logp - prox) * segs.mask_BxT, prox, behav, adv, segs, hp)


@register_loss("ppo", reads_prox=False)
def ppo(logp, prox, behav, adv, segs, hp):
    """Standard clipped PPO: the proximal policy is the behaviour policy (w = 1)."""
    return _ppo_family((logp - behav) * segs.mask_BxT, behav, behav, adv, segs, hp)


@register_loss("gspo")
def gspo(logp, prox, behav, adv, segs, hp):
    """GSPO: one ratio per sequence, the geometric mean of pi_theta / pi_prox over its tokens (with grad)."""
    seq_log_ratio = segs.token_mean((logp - prox) * segs.mask_BxT)
    return _ppo_family(seq_log_ratio, prox, behav, adv, segs, hp)


@register_loss("reinforce_tis", reads_prox=False)
def reinforce_tis(logp, prox, behav, adv, segs, hp):
    """PipelineRL's REINFORCE with truncated IS: -log pi * A * sg(min(pi / pi_behav, 1 + eps_high))."""
    log_ratio = jax.lax.stop_gradient(logp - behav) * segs.mask_BxT
    ratio = jnp.exp(jnp.clip(log_ratio, -30.0, 30.0))
    cap = 1.0 + hp.eps_high
    weight = jnp.minimum(ratio, cap)
    loss = -logp * adv * weight
    zeros = jnp.zeros_like(ratio)
    return loss, {
        "clip_low": zeros,
        "clip_high": (ratio > cap).astype(jnp.float32),
        "dual_clip": zeros,
        "is_weight": ratio,
        "behav_dropped": zeros,
    }


def m2_keep(log_r_BxT, mask_BxT, tau: float) -> jax.Array:
    """M2PO's mask: drops the tokens of largest (log r)^2, fewest first, until the mean of (log r)^2 over
    the remaining loss tokens is <= tau (the mean falls as the largest values go, so the first count
    that satisfies it is the smallest). Returns 1 = kept, 0 = dropped, [B, T], without gradient."""
    sq = jnp.where(mask_BxT > 0, jnp.square(jax.lax.stop_gradient(log_r_BxT)), -1.0).reshape(-1)
    n = jnp.sum(mask_BxT > 0)
    order = jnp.argsort(-sq)
    top = jnp.maximum(sq[order], 0.0)
    removed = jnp.concatenate([jnp.zeros(1, top.dtype), jnp.cumsum(top)])  # sum of the j largest
    j = jnp.arange(removed.size)
    ok = (removed[-1] - removed <= tau * (n - j) + 1e-9) & (j <= n)
    drop_count = jnp.argmax(ok)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.size))
    return (rank >= drop_count).reshape(mask_BxT.shape).astype(jnp.float32)


@register_loss("m2po", reads_prox=False)
def m2po(logp, prox, behav, adv, segs, hp):
    """M2PO (Zheng et al. 2025): no ratio clip; -r A with r = pi_theta / pi_behav on the tokens left once
    the largest (log r)^2 are dropped until their mean is <= m2po_tau. The bound holds per micro-batch,
    so it holds for every update (a mean of values <= tau); it can drop a little more than a whole-batch
    greedy would."""
    log_r = (logp - behav) * segs.mask_BxT
    keep = m2_keep(log_r, segs.mask_BxT, hp.m2po_tau)
    ratio = jnp.exp(jnp.clip(log_r, -30.0, 30.0))
    zeros = jnp.zeros_like(ratio)
    return -ratio * adv * keep, {
        "clip_low": zeros,
        "clip_high": zeros,
        "dual_clip": zeros,
        "is_weight": jax.lax.stop_gradient(ratio),
        "behav_dropped": 1.0 - keep,
    }


def offpolicy_sequence_keep(logp, behav, adv, segs: Segments, delta: float) -> jax.Array:
    """1 except on sequences with A < 0 whose mean log(pi_behav / pi_theta) exceeds delta, [B, T]."""
    seq_kl = segs.token_mean(jax.lax.stop_gradient(behav - logp) * segs.mask_BxT)
    return 1.0 - ((adv < 0) & (seq_kl > delta)).astype(jnp.float32)


def policy_loss(kind: str, logp, prox_logp, behav_logp, advantages, mask, segment_ids=None, **hp):
    """A registered policy loss, aggregated to a (sum, count) pair.

    Args:
      kind: one of LOSS_KINDS (or any name added with `register_loss`).
      logp: [B, T] log pi_theta of the target tokens (carries the gradient).
      prox_logp: [B, T] proximal-policy logprobs (used by decoupled_ppo and gspo; no gradient).
      behav_logp: [B, T] behaviour (sampler) logprobs.
      advantages: [B, T] advantages broadcast to tokens.
      mask: [B, T] 1 for loss tokens (completion tokens), 0 elsewhere.
      segment_ids: optional [B, T] int segment ids of packed rows (0 = padding); None = one sequence a row.
      **hp: LossHParams fields.

    Returns:
      (loss_sum, count, metrics): minimise loss_sum / count; metrics as described in the module docstring.
    """
    if kind not in LOSSES:
        raise ValueError(f"unknown loss {kind!r}; known: {sorted(LOSSES)}")
    params = LossHParams(**hp)
    segs = Segments.make(jnp.asarray(mask), segment_ids)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    logp, prox, behav, adv = f32(logp), f32(prox_logp), f32(behav_logp), f32(advantages)
    prox = jax.lax.stop_gradient(prox)
    loss_BxT, stats = LOSSES[kind](logp, prox, behav, adv, segs, params)
    if set(stats) != set(LOSS_STATS):
        raise ValueError(f"loss {kind!r} returned stats {sorted(stats)}; a loss returns exactly {LOSS_STATS}")
    seq_keep = jnp.ones_like(loss_BxT)
    if params.offpolicy_seq_mask is not None:
        seq_keep = offpolicy_sequence_keep(logp, behav, adv, segs, params.offpolicy_seq_mask)
        loss_BxT = loss_BxT * seq_keep  # dropped sequences stay in the denominator (count is fixed)
    loss_sum, count = aggregate(loss_BxT, segs, params)
    m = segs.mask_BxT
    metrics = {
        "tokens": jnp.sum(m),
        "sequences": segs.num_sequences(),
        "clip_frac_sum": jnp.sum((stats["clip_low"] + stats["clip_high"]) * m),
        "clip_low_frac_sum": jnp.sum(stats["clip_low"] * m),
        "clip_high_frac_sum": jnp.sum(stats["clip_high"] * m),
        "dual_clip_frac_sum": jnp.sum(stats["dual_clip"] * m),
        "is_weight_sum": jnp.sum(stats["is_weight"] * m),
        "is_weight_max": jnp.max(stats["is_weight"] * m),
        "behav_dropped_frac_sum": jnp.sum(stats["behav_dropped"] * m),
        "offpolicy_masked_frac_sum": jnp.sum((1.0 - seq_keep) * m),
    }
    return loss_sum, count, metrics


def combine_metrics(a: dict, b: dict) -> dict:
    """Combines two micro-batches' metric dicts (max for `*_max` keys, + otherwise)."""
    return {k: jnp.maximum(a[k], b[k]) if k.endswith("_max") else a[k] + b[k] for k in a}


def effective_sample_fraction(m: dict) -> jax.Array:
    """Kish's effective sample size of rho = pi_theta / pi_behav over the loss tokens, as a fraction of
    them: (sum rho)^2 / (n sum rho^2), in (0, 1]; 1 = on-policy. Needs the `rho_sum`, `rho_sq_sum` and
    `tokens` sums (micro-batch sums add, so the fraction is exact for any split)."""
    n = jnp.maximum(m["tokens"], 1.0)
    return jnp.clip(jnp.square(m["rho_sum"]) / (n * jnp.maximum(m["rho_sq_sum"], 1e-30)), 0.0, 1.0)


def finalize_metrics(m: dict) -> dict:
    """Turns per-token `*_sum` entries into means (`clip_frac_sum` -> `clip_frac`, `x_sum` -> `x_mean`);
    with the rho sums, adds `ess_frac` (effective_sample_fraction)."""
    out = {}
    if "rho_sum" in m:
        out["ess_frac"] = effective_sample_fraction(m)
    tokens = jnp.maximum(m["tokens"], 1.0)
    for k, v in m.items():
        if k.endswith("_frac_sum"):
            out[k[: -len("_sum")]] = v / tokens
        elif k.endswith("_sum"):
            out[k[: -len("_sum")] + "_mean"] = v / tokens
        else:
            out[k] = v
    return out
