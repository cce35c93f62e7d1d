"""The train state and step: prox logprobs, micro-batch gradient accumulation, skip-on-non-finite update.

One `train_step` = exactly `cfg.minibatches` optimizer updates, each over its own share of the batch's
groups packed into micro-batches of its own (`prepare_batch`). Each micro-batch runs one jitted
forward/backward that adds its gradient of `loss_sum` (and `count`, metrics) into a donated
accumulator; a second jitted function divides by the update's count, clips, applies AdamW and
keeps the old parameters if the loss or gradient norm is not finite. Both compile once per micro-batch
shape, so a variable number of micro-batches per step never recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxrl_async.model import (
    ModelConfig,
    chunked_token_logprobs,
    forward,
    param_shardings,
)
from jaxrl_async.sharding import TRAINER_RULES
from jaxrl_async.trainer import adapters
from jaxrl_async.trainer.advantages import compute_advantages, kl_estimate
from jaxrl_async.trainer.config import TrainConfig
from jaxrl_async.trainer.losses import (
    LossHParams,
    Segments,
    aggregate,
    combine_metrics,
    effective_sample_fraction,
    finalize_metrics,
    policy_loss,
    reads_prox,
)
from jaxrl_async.trainer.optimizer import make_optimizer, update_schedule
from jaxrl_async.trainer.packing import FIELD_DTYPES, PackedBatch, TrainSample, batch_seed, pack_minibatches


@struct.dataclass
class TrainState:
    """Trainer state; `params` keeps the model's nested-dict layout (reshard it with jax.device_put).

    Attributes:
      params: master weights (model param_dtype), sharded on `mesh` by TRAINER_RULES when given; with
        config.trainer.lora the adapters only (float32), the one tree with gradients and AdamW state.
      opt_state: optax state, sharded like the parameters.
      version: int32 policy version: +1 per train step that applied at least one update.
      updates, skipped: int32 counts of applied and skipped (non-finite) optimizer updates.
      ref_params: frozen reference parameters for the KL penalty (in the compute dtype), or None.
      frozen: with LoRA, the frozen base in the compute dtype (also the KL reference); else None.
      cfg, model_cfg, mesh: static; model_cfg.dtype is the compute dtype.
    """

    params: Any
    opt_state: Any
    version: jax.Array
    updates: jax.Array
    skipped: jax.Array
    ref_params: Any
    frozen: Any
    cfg: TrainConfig = struct.field(pytree_node=False)
    model_cfg: ModelConfig = struct.field(pytree_node=False)
    mesh: Mesh | None = struct.field(pytree_node=False)


def loglinear_prox_logp(behav_BxT, logp_BxT, versions_BxT, prox_version):
    """AReaL's log-linear estimate of log pi_prox from version stamps, without a forward pass.

    log pi is assumed to move linearly with the policy version. A token sampled at version v_b, the
    proximal policy at v_prox (the weights at the start of this step) and the policy being optimised at
    v_prox + 1 give alpha = (v_prox - v_b) / (v_prox + 1 - v_b) in [0, 1], and log pi_prox is taken
    alpha of the way from the behaviour logprob to the current one: fresh tokens (v_b = v_prox) keep
    their behaviour logprob, very stale ones approach the current policy's.
    """
    v_b = versions_BxT.astype(jnp.float32)
    v_p = jnp.asarray(prox_version, jnp.float32)
    alpha = jnp.clip((v_p - v_b) / jnp.maximum(v_p + 1.0 - v_b, 1.0), 0.0, 1.0)
    return behav_BxT + alpha * (jax.lax.stop_gradient(logp_BxT) - behav_BxT)


def _replicated(mesh: Mesh | None):
    """Where scalars live: replicated over the mesh, or committed to the default device."""
    if mesh is None:
        return SingleDeviceSharding(jax.local_devices()[0])
    return NamedSharding(mesh, PartitionSpec())


def _reference_copy(tree, shardings, dtype: str):
    """The frozen KL reference: a copy of `tree` in the compute dtype (it is only ever run forward, so
    bfloat16 compute halves its memory next to float32 master weights), placed like the parameters."""
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return jax.jit(lambda t: jax.tree.map(cast, t), out_shardings=shardings)(tree)


def _fresh_copy(tree, shardings):
    """New buffers placed by `shardings`: the step donates the state, which must not delete the caller's
    arrays (a device_put may alias a buffer already in place)."""
    return jax.jit(lambda t: jax.tree.map(lambda x: x * jnp.ones((), x.dtype), t), out_shardings=shardings)(
        tree
    )


def _with_compute_dtype(cfg: TrainConfig, model_cfg: ModelConfig) -> ModelConfig:
    if cfg.compute_dtype is None or cfg.compute_dtype == model_cfg.dtype:
        return model_cfg
    return dataclasses.replace(model_cfg, dtype=cfg.compute_dtype)


def create_train_state(
    cfg: TrainConfig, model_cfg: ModelConfig, params, mesh: Mesh | None = None, ref_params=None,
    adapter_key=None,
) -> TrainState:
    """A fresh TrainState (version 0) around `params`.

    Args:
      cfg: trainer config.
      model_cfg: model config; its dtype is replaced by cfg.compute_dtype when that is set.
      params: nested-dict parameters (any placement); moved onto `mesh` with TRAINER_RULES.
      mesh: trainer mesh with axes ("fsdp", "tensor"), or None for the default device.
      ref_params: reference parameters for the KL penalty (required when cfg.kl_coef > 0); a copy in
        the compute dtype is kept, so the caller's arrays are neither donated nor held. With LoRA the
        base is the reference and this is not read.
      adapter_key: seeds fresh LoRA adapters (config.trainer.lora; default key 0). `params` is then the
        base, which is frozen.
    """
    if cfg.lora.enabled:
        cfg.lora.check_model(model_cfg)  # before anything compiles, naming config.trainer.lora.rank
    if cfg.kl_coef > 0 and ref_params is None and not cfg.lora.enabled:
        raise ValueError("TrainConfig.kl_coef > 0 needs ref_params")
    model_cfg = _with_compute_dtype(cfg, model_cfg)
    if mesh is not None and cfg.rows_per_micro % mesh.shape["fsdp"]:
        raise ValueError(f"rows_per_micro={cfg.rows_per_micro} not a multiple of fsdp={mesh.shape['fsdp']}")
    if mesh is None:
        shardings = jax.tree.map(lambda _: _replicated(None), params)
    else:
        shardings = param_shardings(model_cfg, mesh, TRAINER_RULES)
    frozen = None
    if cfg.lora.enabled:
        params, frozen = adapters.split_initial(cfg, model_cfg, params, shardings, mesh, adapter_key)
    else:
        params = _fresh_copy(params, shardings)
    if ref_params is not None and cfg.kl_coef > 0 and not cfg.lora.enabled:
        ref_params = _reference_copy(ref_params, shardings, model_cfg.dtype)
    tx = make_optimizer(cfg)
    # Optimizer moments live where their parameters do; step counts are replicated. Explicit output
    # shardings also commit the buffers, so the first step does not compile a second variant.
    param_sh = jax.tree.map(lambda x: x.sharding, params)
    opt_sh = optax.tree_utils.tree_map_params(
        tx,
        lambda _, sh: sh,
        jax.eval_shape(tx.init, params),
        param_sh,
        transform_non_params=lambda _: _replicated(mesh),
    )
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    # Distinct, committed buffers: the step donates each of them and recompiles on placement changes.
    zero = lambda: jax.device_put(np.zeros((), np.int32), _replicated(mesh))
    return TrainState(
        params,
        opt_state,
        zero(),
        zero(),
        zero(),
        ref_params if cfg.kl_coef > 0 and not cfg.lora.enabled else None,
        frozen,
        cfg,
        model_cfg,
        mesh,
    )


def prepare_batch(
    cfg: TrainConfig, rollouts: Sequence[TrainSample], max_row_segments: int | None = None
) -> PackedBatch:
    """Advantages (cfg.advantage over reward / group_id), then cfg.minibatches disjoint, seeded-shuffled,
    token-balanced shares of whole groups, each packed into micro-batches of its own (one per update).

    With cfg.skip_zero_advantage, sequences whose advantage is 0 are left out, unless that leaves fewer
    groups than updates (then all are kept, so every update still has a share); `batch.num_skipped`
    counts them. `max_row_segments` caps the sequences per packed row (the model's attention decides it:
    `model.attention.row_segment_cap`; None = no cap).

    Raises:
      ValueError: the batch has fewer groups than cfg.minibatches (names config.trainer.minibatches).
    """
    adv = np.asarray(
        compute_advantages(cfg.advantage, [r.reward for r in rollouts], [r.group_id for r in rollouts])
    )
    skipped = 0
    if cfg.skip_zero_advantage:
        keep = np.flatnonzero(np.abs(adv) > 1e-8)
        kept_groups = len({rollouts[i].group_id for i in keep})
        if 0 < len(keep) < len(rollouts) and kept_groups >= cfg.minibatches:
            skipped = len(rollouts) - len(keep)
            rollouts, adv = [rollouts[i] for i in keep], adv[keep]
    seed = batch_seed(cfg.minibatch_seed, [r.group_id for r in rollouts])
    batch = pack_minibatches(
        rollouts, adv, cfg.token_budget, cfg.rows_per_micro, cfg.minibatches, seed, max_row_segments
    )
    return dataclasses.replace(batch, num_skipped=skipped)


@dataclasses.dataclass(frozen=True)
class _Compiled:
    logprobs: Any
    accumulate: Any
    apply: Any
    zero_acc: Any
    acc_layout: Any
    batch_sharding: Any


def _model_logprobs(cfg: TrainConfig, model_cfg: ModelConfig, params, mb, remat: bool, mesh=None):
    hidden_BxTxD = forward(
        model_cfg,
        params,
        mb["tokens"],
        mb["positions"],
        segment_ids=mb["segment_ids"],
        remat=remat,
        return_hidden=True,
        mesh=mesh,
        unroll=cfg.unroll_layers,
    )
    return chunked_token_logprobs(
        model_cfg, params, hidden_BxTxD, mb["targets"], cfg.temperature, cfg.logits_chunk
    )


# Lag bands of the drift split (name, lowest lag, highest lag): lag = trainer version - token version.
DRIFT_BANDS = (("lag0", 0, 0), ("lag1", 1, 1), ("lag2_3", 2, 3), ("lag4_7", 4, 7), ("lag8_up", 8, 2**30))


def drift_sums(log_ratio_BxT, staleness_BxT, mask_BxT, behav_cap: float) -> dict:
    """Per lag band: the loss tokens (`drift_<band>_count`), the sum of log(pi_theta / pi_behav) over them
    (`..._log_ratio_total`) and how many have pi_theta / pi_behav above the behaviour cap
    (`..._over_cap_count`). Lag 0 tokens were sampled by the very weights that score them, so their
    log-ratio is the sampler/trainer mismatch alone; the other bands add staleness on top. Sums, so
    micro-batches add exactly (`combine_metrics`); `learner_log.drift_values` turns them into means."""
    over_BxT = (log_ratio_BxT > jnp.log(behav_cap)) * mask_BxT
    out = {}
    for name, lo, hi in DRIFT_BANDS:
        band_BxT = mask_BxT * (staleness_BxT >= lo) * (staleness_BxT <= hi)
        out[f"drift_{name}_count"] = jnp.sum(band_BxT)
        out[f"drift_{name}_log_ratio_total"] = jnp.sum(log_ratio_BxT * band_BxT)
        out[f"drift_{name}_over_cap_count"] = jnp.sum(over_BxT * band_BxT)
    return out


def _micro_loss(cfg, model_cfg, mesh, params, ref_params, frozen, mb, prox_BxT, prox_version):
    """(loss_sum, (count, metrics)) of one micro-batch; gradients flow through `params` only (with LoRA
    the adapters: the base `frozen` is an input, and the KL reference)."""
    if frozen is not None:
        ref_params = frozen
    model_params = adapters.model_params(cfg, params, frozen)
    logp, entropy = _model_logprobs(cfg, model_cfg, model_params, mb, cfg.remat, mesh)
    mask, behav, seg = mb["loss_mask"], mb["behav_logp"], mb["segment_ids"]
    if not reads_prox(cfg.loss):
        prox = behav
    elif cfg.prox_mode == "loglinear":
        prox = loglinear_prox_logp(behav, logp, mb["versions"], prox_version)
    elif prox_BxT is None:
        # One update per step: the weights are still the proximal ones, so pi_prox is this forward's value.
        prox = jax.lax.stop_gradient(logp)
    else:
        prox = prox_BxT
    hp = cfg.loss_hparams()
    loss_sum, count, m = policy_loss(
        cfg.loss, logp, prox, behav, mb["advantages"], mask, segment_ids=seg, **hp
    )
    m["entropy_sum"] = jnp.sum(entropy * mask)
    m["kl_behav_sum"] = jnp.sum(kl_estimate("k3", behav, logp) * mask)
    # rho = pi_theta / pi_behav (no gradient), every loss alike: its effective sample size says how much
    # of the batch the current weights can still learn from (Kish: (sum rho)^2 / (n sum rho^2)).
    rho = jnp.exp(jnp.clip(jax.lax.stop_gradient(logp) - behav, -30.0, 30.0)) * mask
    m["rho_sum"], m["rho_sq_sum"] = jnp.sum(rho), jnp.sum(rho * rho)
    if cfg.kl_coef > 0:
        ref_logp, _ = _model_logprobs(cfg, model_cfg, jax.lax.stop_gradient(ref_params), mb, False, mesh)
        kl_BxT = kl_estimate(cfg.kl_estimator, logp, ref_logp)
        kl_sum, _ = aggregate(kl_BxT, Segments.make(mask, seg), LossHParams(**hp))
        loss_sum = loss_sum + cfg.kl_coef * kl_sum
        m["kl_ref_sum"] = jnp.sum(kl_BxT * mask)
    staleness = jnp.maximum(prox_version - mb["versions"], 0)
    m["staleness_sum"] = jnp.sum(staleness * mask)
    m["staleness_max"] = jnp.max(staleness * mask).astype(jnp.float32)
    bins = jnp.minimum(staleness, cfg.staleness_bins - 1).reshape(-1)
    m["staleness_hist"] = jax.ops.segment_sum(mask.reshape(-1), bins, num_segments=cfg.staleness_bins)
    log_ratio = (jax.lax.stop_gradient(logp) - behav) * mask
    m.update(drift_sums(log_ratio, staleness, mask, hp["behav_cap"]))
    m["input_tokens"] = jnp.sum(seg > 0).astype(jnp.float32)
    return loss_sum, (count, m)


@functools.lru_cache(maxsize=32)
def _compile(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh | None) -> _Compiled:
    tx = make_optimizer(cfg)
    schedule = update_schedule(cfg)
    param_sh = adapters.trainable_shardings(cfg, model_cfg, mesh)
    replicated = _replicated(mesh)
    batch_sh = replicated if mesh is None else NamedSharding(mesh, TRAINER_RULES.spec(("batch", "seq")))

    def constrain(grads):
        return grads if param_sh is None else jax.lax.with_sharding_constraint(grads, param_sh)

    def grads_of(params, ref_params, frozen, mb, prox_BxT, prox_version):
        loss_fn = functools.partial(_micro_loss, cfg, model_cfg, mesh)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss_sum, (count, m)), grads = grad_fn(params, ref_params, frozen, mb, prox_BxT, prox_version)
        return {"grads": constrain(grads), "loss_sum": loss_sum, "count": count, "metrics": m}

    def accumulate(params, ref_params, frozen, acc, mb, prox_BxT, prox_version):
        new = grads_of(params, ref_params, frozen, mb, prox_BxT, prox_version)
        return {
            "grads": jax.tree.map(jnp.add, acc["grads"], new["grads"]),
            "loss_sum": acc["loss_sum"] + new["loss_sum"],
            "count": acc["count"] + new["count"],
            "metrics": combine_metrics(acc["metrics"], new["metrics"]),
        }

    def apply(state: TrainState, acc):
        count = jnp.maximum(acc["count"], 1.0)
        grads = jax.tree.map(lambda g: (g / count).astype(g.dtype), acc["grads"])
        loss = acc["loss_sum"] / count
        grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt = tx.update(grads, state.opt_state, state.params)
        ess = effective_sample_fraction(acc["metrics"])
        if cfg.ess_scaled_step:  # the step shrinks with the share of the batch the weights still use
            updates = jax.tree.map(lambda u: (u * ess).astype(u.dtype), updates)
        new_params = optax.apply_updates(state.params, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
        lr = schedule(state.updates)
        state = state.replace(
            params=keep(new_params, state.params),
            opt_state=keep(new_opt, state.opt_state),
            updates=state.updates + ok.astype(jnp.int32),
            skipped=state.skipped + (~ok).astype(jnp.int32),
        )
        return state, {"loss": loss, "grad_norm": grad_norm, "applied": ok, "lr": lr, "ess": ess}

    zero_fns = {}

    def acc_layout(params, ref_params, frozen, mb, prox_version):
        """(shapes, shardings) of the gradient accumulator for this micro-batch shape."""
        shapes = jax.eval_shape(grads_of, params, ref_params, frozen, mb, None, prox_version)
        rep = lambda tree: jax.tree.map(lambda _: replicated, tree)
        grad_sh = rep(shapes["grads"]) if param_sh is None else param_sh
        out_sh = {
            "grads": grad_sh,
            "loss_sum": replicated,
            "count": replicated,
            "metrics": rep(shapes["metrics"]),
        }
        return shapes, out_sh

    def zero_acc(params, ref_params, frozen, mb, prox_version):
        """A zero accumulator with every leaf committed where `accumulate` returns it (no recompiles)."""
        key = jax.tree.map(lambda x: (x.shape, x.dtype), mb)
        key = tuple(jax.tree.leaves(key))
        if key not in zero_fns:
            shapes, out_sh = acc_layout(params, ref_params, frozen, mb, prox_version)
            zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            zero_fns[key] = jax.jit(zeros, out_shardings=out_sh)
        return zero_fns[key]()

    logprobs = lambda params, frozen, mb: _model_logprobs(
        cfg, model_cfg, adapters.model_params(cfg, params, frozen), mb, False, mesh
    )[0]
    return _Compiled(
        logprobs=jax.jit(logprobs),
        accumulate=jax.jit(accumulate, donate_argnums=(3,)),
        apply=jax.jit(apply, donate_argnums=(0,)),
        zero_acc=zero_acc,
        acc_layout=acc_layout,
        batch_sharding=batch_sh,
    )


def compile_abstract(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh, compile_fn=None) -> dict:
    """The train step's programs compiled for `mesh` on abstract arrays (nothing is allocated), each
    `jax.stages.Lowered` by `compile_fn` (default: `.compile()`).

    Returns:
      {"state": the abstract TrainState (ShapeDtypeStructs with their shardings), "accumulate": one
      micro-batch's forward/backward into the gradient accumulator, "apply": the
      optimizer update, "logprobs": the pi_prox forward (None unless minibatches > 1 recomputes it),
      "optimizer_state_bytes": per-device bytes of the optimizer state, which stays live (but is not an
      argument) while `accumulate` runs}.
    """
    out = trace_abstract(cfg, model_cfg, mesh)
    compile_fn = compile_fn or (lambda lowered: lowered.compile())
    for name in ("accumulate", "apply", "logprobs"):
        if out[name] is not None:
            out[name] = compile_fn(out[name].lower())
    return out


def lower_abstract(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh, platforms: tuple[str, ...]) -> dict:
    """`compile_abstract`'s programs lowered for `platforms` (e.g. ("cuda",)), not compiled: a program for
    an accelerator built on CPU devices (name the target in ModelConfig.platform so that its attention
    kernel is the target's). Keys as `compile_abstract`'s, each program a `jax.stages.Lowered`."""
    out = trace_abstract(cfg, model_cfg, mesh)
    for name in ("accumulate", "apply", "logprobs"):
        if out[name] is not None:
            out[name] = out[name].lower(lowering_platforms=tuple(platforms))
    return out


def trace_abstract(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh) -> dict:
    """`compile_abstract`'s programs traced on abstract arrays (`jax.stages.Traced`), neither lowered nor
    compiled."""
    model_cfg = _with_compute_dtype(cfg, model_cfg)
    fns = _compile(cfg, model_cfg, mesh)
    params = adapters.abstract_trainable(cfg, model_cfg, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, params)
    spec_of = lambda tree, sh: jax.tree.map(
        lambda s, x: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=x), tree, sh
    )
    frozen = adapters.abstract_frozen(cfg, model_cfg, mesh)
    tx = make_optimizer(cfg)
    replicated = _replicated(mesh)
    opt_shapes = jax.eval_shape(tx.init, params)
    opt_sh = optax.tree_utils.tree_map_params(
        tx, lambda _, sh: sh, opt_shapes, shardings, transform_non_params=lambda _: replicated
    )
    opt_state = spec_of(opt_shapes, opt_sh)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    shape = (cfg.rows_per_micro, cfg.token_budget)
    mb = {k: jax.ShapeDtypeStruct(shape, dt, sharding=fns.batch_sharding) for k, dt in FIELD_DTYPES.items()}
    ref = None
    if cfg.kl_coef > 0 and frozen is None:  # the reference, in the compute dtype (see _reference_copy)
        as_compute = lambda x: jax.ShapeDtypeStruct(x.shape, model_cfg.dtype, sharding=x.sharding)
        ref = jax.tree.map(as_compute, params)
    acc = spec_of(*fns.acc_layout(params, ref, frozen, mb, scalar))
    recompute = reads_prox(cfg.loss) and cfg.prox_mode == "recompute" and cfg.minibatches > 1
    prox = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=fns.batch_sharding) if recompute else None
    state = TrainState(params, opt_state, scalar, scalar, scalar, ref, frozen, cfg, model_cfg, mesh)
    per_device = lambda tree: sum(
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )
    return {
        "state": state,
        "accumulate": fns.accumulate.trace(params, ref, frozen, acc, mb, prox, scalar),
        "apply": fns.apply.trace(state, acc),
        "logprobs": fns.logprobs.trace(params, frozen, mb) if recompute else None,
        "optimizer_state_bytes": per_device(opt_state),
    }


def _device_batch(fns: _Compiled, batch: PackedBatch) -> list[dict]:
    return [jax.device_put(batch.micro_batch(i), fns.batch_sharding) for i in range(batch.num_micro)]


def _accumulate(fns: _Compiled, state: TrainState, mbs: list, prox: list, prox_version):
    acc = fns.zero_acc(state.params, state.ref_params, state.frozen, mbs[0], prox_version)
    for mb, prox_BxT in zip(mbs, prox, strict=True):
        acc = fns.accumulate(
            state.params, state.ref_params, state.frozen, acc, mb, prox_BxT, prox_version
        )
    return acc


def train_step(state: TrainState, batch: PackedBatch) -> tuple[TrainState, dict]:
    """One trainer step over a packed batch (see module docstring); `state` is donated.

    A batch whose micro-batch shape differs from (rows_per_micro, token_budget) works but compiles anew.

    Returns:
      (new state, metrics): device scalars (loss, grad_norm, lr, updates (applied this step), ess_frac,
      ess_step_min (the smallest update's ESS fraction), clip_frac, dual_clip_frac,
      is_weight_mean, is_weight_max, behav_dropped_frac, entropy_mean, kl_behav_mean, [kl_ref_mean],
      staleness_mean, staleness_max, tokens, input_tokens, sequences, skipped, version) and
      staleness_hist [staleness_bins] (per-token counts of trainer version - token version, the last
      bin holding all larger values), and the drift split's sums per lag band (`drift_sums`). Fetch them
      after dispatching the next step to avoid a sync.
    """
    cfg = state.cfg
    groups = batch.update_groups()
    if len(groups) != cfg.minibatches:
        raise ValueError(
            f"config.trainer.minibatches={cfg.minibatches} but the batch is split into {len(groups)} "
            "update(s); build it with prepare_batch(cfg, rollouts)"
        )
    fns = _compile(cfg, state.model_cfg, state.mesh)
    mbs = _device_batch(fns, batch)
    prox_version = state.version + 0  # a buffer of its own: each update donates the state
    prox = [None] * len(mbs)
    if reads_prox(cfg.loss) and cfg.prox_mode == "recompute" and cfg.minibatches > 1:
        # once, before any update of this step
        prox = [fns.logprobs(state.params, state.frozen, mb) for mb in mbs]
    raw, loss_sum, count, outs = None, 0.0, 0.0, []
    for group in groups:
        acc = _accumulate(fns, state, [mbs[i] for i in group], [prox[i] for i in group], prox_version)
        raw = acc["metrics"] if raw is None else combine_metrics(raw, acc["metrics"])
        loss_sum, count = loss_sum + acc["loss_sum"], count + acc["count"]
        state, out = fns.apply(state, acc)
        outs.append(out)
    applied = sum(o["applied"].astype(jnp.int32) for o in outs)
    state = state.replace(version=state.version + (applied > 0).astype(jnp.int32))
    metrics = finalize_metrics(raw)
    metrics.update(
        loss=loss_sum / jnp.maximum(count, 1.0),
        grad_norm=sum(o["grad_norm"] for o in outs) / len(outs),
        lr=outs[-1]["lr"],
        skipped=len(outs) - applied,
        updates=applied,
        ess_step_min=functools.reduce(jnp.minimum, [o["ess"] for o in outs]),
        version=state.version,
    )
    if state.frozen is not None:  # LoRA: how far the adapters have moved the policy from the base
        metrics["adapter_norm"] = optax.tree.norm(state.params)
    return state, metrics


def loss_and_grads(state: TrainState, batch: PackedBatch) -> tuple[jax.Array, Any, dict]:
    """(loss, gradient, metrics) of the whole batch at the current weights, without updating anything."""
    fns = _compile(state.cfg, state.model_cfg, state.mesh)
    mbs = _device_batch(fns, batch)
    acc = _accumulate(fns, state, mbs, [None] * len(mbs), state.version)
    count = jnp.maximum(acc["count"], 1.0)
    grads = jax.tree.map(lambda g: g / count, acc["grads"])
    return acc["loss_sum"] / count, grads, finalize_metrics(acc["metrics"])


def compute_logprobs(state: TrainState, batch: PackedBatch) -> np.ndarray:
    """Trainer logprobs [M, R, S] of every target token of a packed batch under the current weights."""
    fns = _compile(state.cfg, state.model_cfg, state.mesh)
    return np.stack(
        [np.asarray(fns.logprobs(state.params, state.frozen, mb)) for mb in _device_batch(fns, batch)]
    )
