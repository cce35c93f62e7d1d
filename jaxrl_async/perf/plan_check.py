"""Plan check: compile a config's train step for its trainer mesh on abstract arrays and report memory.

Nothing is allocated: parameters, optimizer state and the micro-batch are ShapeDtypeStructs carrying the
trainer shardings, and XLA's compiled memory analysis gives the per-device argument, output and
temporary bytes. On a CPU-only machine the mesh is made of fake CPU devices (the caller creates enough
before JAX starts), so a user learns before launch whether params + optimizer + activations fit.
The sampler's `generate` (weights, KV cache, decode temporaries) is compiled the same way for the sampler
mesh (see `decode_memory` for bf16 on XLA:CPU); an analytic size (weights + slots x slot length x layers x
2 x KV heads x head dim) is reported beside it as a cross-check. `paged_kv_plan` sizes the paged KV cache
an accelerator sampler uses (SamplerConfig.attention "auto" / "paged_kernel") in the memory the compiled
program leaves free: pages per device and the sequences that run at once, at full length and on a
long-tailed length mix under the sampler's admission rule.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxrl_async.model import ModelConfig, abstract_params, forward, token_logprobs
from jaxrl_async.sampler import Engine
from jaxrl_async.sharding import SAMPLER_RULES, TRAINER_RULES, make_mesh
from jaxrl_async.trainer import TrainConfig, make_optimizer, policy_loss


def _train_update(cfg: TrainConfig, model_cfg: ModelConfig, tx, params, opt_state, mb: dict):
    """One micro-batch forward/backward plus the optimizer update (the train step's memory peak)."""

    def loss_fn(p):
        logits, _ = forward(
            model_cfg, p, mb["tokens"], mb["positions"], segment_ids=mb["segment_ids"], remat=cfg.remat
        )
        logp, _ = token_logprobs(logits, mb["targets"], cfg.temperature)
        prox = jax.lax.stop_gradient(logp)
        loss_sum, count, _ = policy_loss(
            cfg.loss,
            logp,
            prox,
            mb["behav_logp"],
            mb["advantages"],
            mb["loss_mask"],
            segment_ids=mb["segment_ids"],
            **cfg.loss_hparams(),
        )
        return loss_sum / jnp.maximum(count, 1.0)

    grads = jax.grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def train_memory(cfg: TrainConfig, model_cfg: ModelConfig, trainer_shape: tuple[int, int], devices) -> dict:
    """Per-device bytes of the compiled train update on a (fsdp, tensor) mesh over `devices`."""
    mesh = make_mesh(trainer_shape, ("fsdp", "tensor"), devices)
    if cfg.compute_dtype:
        model_cfg = dataclasses.replace(model_cfg, dtype=cfg.compute_dtype)
    params = abstract_params(model_cfg, mesh, TRAINER_RULES)
    tx = make_optimizer(cfg)
    opt_shapes = jax.eval_shape(tx.init, params)
    param_sh = jax.tree.map(lambda x: x.sharding, params)
    opt_sh = optax.tree_utils.tree_map_params(
        tx,
        lambda _, s: s,
        opt_shapes,
        param_sh,
        transform_non_params=lambda _: TRAINER_RULES.sharding(mesh, ()),
    )
    opt_state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt_shapes, opt_sh
    )
    row = TRAINER_RULES.sharding(mesh, ("batch", "seq"), (cfg.rows_per_micro, cfg.token_budget))
    shape = (cfg.rows_per_micro, cfg.token_budget)
    ints = ("tokens", "targets", "positions", "segment_ids")
    mb = {
        k: jax.ShapeDtypeStruct(shape, jnp.int32 if k in ints else jnp.float32, sharding=row)
        for k in (*ints, "behav_logp", "advantages", "loss_mask")
    }
    fn = jax.jit(
        lambda p, o, b: _train_update(cfg, model_cfg, tx, p, o, b),
        donate_argnums=(0, 1),
        out_shardings=(param_sh, opt_sh),
    )
    return compiled_memory(fn.lower(params, opt_state, mb).compile())


def compiled_memory(compiled) -> dict[str, int]:
    """Per-device bytes from XLA's memory analysis of a compiled program, plus a peak estimate."""
    mem = compiled.memory_analysis()
    out = {
        k: int(getattr(mem, k + "_in_bytes", 0) or 0)
        for k in ("argument_size", "output_size", "temp_size", "alias_size", "generated_code_size")
    }
    out["peak_estimate"] = out["argument_size"] + out["output_size"] - out["alias_size"] + out["temp_size"]
    return out


def kv_cache_bytes(
    model_cfg: ModelConfig,
    num_slots: int,
    slot_len: int,
    sampler_shape: tuple[int, int],
    dtype_bytes: int = 2,
) -> int:
    """Per-device KV-cache bytes: slots split over the data axis, KV heads over tensor when divisible."""
    data, tensor = sampler_shape
    heads = model_cfg.n_kv_heads // tensor if model_cfg.n_kv_heads % tensor == 0 else model_cfg.n_kv_heads
    per_slot = 2 * model_cfg.n_layers * heads * model_cfg.head_dim * slot_len * dtype_bytes
    return -(-num_slots // data) * per_slot


def sampler_weight_bytes(model_cfg: ModelConfig, sampler_shape: tuple[int, int], dtype_bytes: int = 2) -> int:
    """Per-device sampler weight bytes under SAMPLER_RULES (replicated over data, split over tensor)."""
    import numpy as np

    from jaxrl_async.model import param_specs

    mesh_sizes = {"data": sampler_shape[0], "tensor": sampler_shape[1]}
    total = 0
    for spec in jax.tree.leaves(param_specs(model_cfg), is_leaf=lambda x: hasattr(x, "logical_axes")):
        table = dict(SAMPLER_RULES.mapping)
        n = int(np.prod(spec.shape))
        for dim, axis in zip(spec.shape, spec.logical_axes, strict=True):
            mesh_axis = table.get(axis)
            if mesh_axis and dim % mesh_sizes[mesh_axis] == 0:
                n //= mesh_sizes[mesh_axis]
        total += n * dtype_bytes
    return total


def decode_memory(model_cfg: ModelConfig, sampler_cfg: Any, sampler_shape: tuple[int, int], devices) -> dict:
    """Per-device bytes of the sampler's compiled `generate` on a (data, tensor) mesh over `devices`.

    XLA:CPU has no bfloat16 matmul: it converts bf16 operands (weights, KV cache) to f32 copies, which show
    up as temporaries an accelerator would not need. For a bf16 model the same step is therefore also
    compiled in f32, and its temporaries (f32 activations, an upper bound for bf16 ones) are reported as
    `temp_size_accelerator`; `peak_accelerator` = arguments + outputs - aliased + those temporaries.
    """
    mesh = make_mesh(sampler_shape, ("data", "tensor"), devices)
    out = compiled_memory(Engine(model_cfg, None, mesh, sampler_cfg).compile_generate())
    temps = out["temp_size"]
    if jnp.dtype(model_cfg.dtype) == jnp.bfloat16 or jnp.dtype(model_cfg.param_dtype) == jnp.bfloat16:
        f32 = dataclasses.replace(model_cfg, dtype="float32", param_dtype="float32")
        temps = compiled_memory(Engine(f32, None, mesh, sampler_cfg).compile_generate())["temp_size"]
    out["temp_size_accelerator"] = temps
    out["peak_accelerator"] = out["argument_size"] + out["output_size"] - out["alias_size"] + temps
    return out


def paged_kv_plan(
    model_cfg: ModelConfig,
    sampler_cfg: Any,
    sampler_shape: tuple[int, int],
    free_bytes: float,
    median_len: float,
    p99_len: float,
    group: int,
    prompt_len: int,
) -> dict:
    """Paged KV sizing: what `free_bytes` per device holds.

    A data shard's pages live on its `tensor` devices, each holding its KV heads' slice of every page, so
    a device holds `free_bytes // page_bytes` pages and the sampler runs `data` times as many sequences as
    one shard. "long tail": a lognormal length mix (median, p99, capped at max_new_tokens) under the
    sampler's admission rule (`kv_tokens_per_sequence(..., "paged")`, shared prompt pages for `group`).
    "slotted": the slotted cache in the same memory (every slot max_prompt_len + max_new_tokens).
    """
    from jaxrl_async.perf.system import kv_tokens_per_sequence
    from jaxrl_async.perf.workload import LogNormalLengths, Workload
    from jaxrl_async.sampler.page_table import pages_for

    data, tensor = sampler_shape
    dtype_bytes = jnp.dtype(model_cfg.dtype).itemsize
    per_token = kv_cache_bytes(model_cfg, 1, 1, (1, tensor), dtype_bytes)  # one position, K and V, per device
    ps = sampler_cfg.page_size
    pages = int(max(free_bytes, 0) // (per_token * ps))
    per_seq = pages_for(sampler_cfg.max_seq_len, ps)
    lengths = LogNormalLengths(median_len, p99_len, max_len=sampler_cfg.max_new_tokens)
    workload = Workload(1, group, prompt_len, lengths)
    tokens = kv_tokens_per_sequence(workload, "paged", ps, sampler_cfg.steps_per_call)
    long_tail = data * int(pages * ps // tokens)
    return {
        "page_size": ps,
        "page_bytes": per_token * ps,
        "free_bytes": int(free_bytes),
        "pages_per_device": pages,
        "sequences_at_max_len": data * (pages // per_seq),
        "sequences_long_tail": long_tail,
        "long_tail": {
            "median": median_len,
            "p99": p99_len,
            "prompt_len": prompt_len,
            "group": group,
            "kv_tokens_per_sequence": tokens,
        },  # fmt: skip
        "sequences_slotted": data * int(free_bytes // (per_token * sampler_cfg.max_seq_len)),
        "num_slots": sampler_cfg.num_slots,
        "decode_batch_long_tail": min(long_tail, sampler_cfg.num_slots),
    }


def plan_check(model_cfg: ModelConfig, train_cfg: TrainConfig, sampler: Any, mesh: Any) -> dict:
    """Memory per device for the trainer and the sampler, both from compiled programs.

    The sampler's analytic weights + KV-cache figure is kept beside the compiled one as a cross-check.

    Args:
      model_cfg: the model.
      train_cfg: TrainConfig of the run.
      sampler: SamplerConfig of the run (num_slots, slot_len).
      mesh: object with `sampler` (data, tensor) and `trainer` (fsdp, tensor) shapes.
    """
    devices = jax.devices()
    ns = mesh.sampler[0] * mesh.sampler[1]
    nt = mesh.trainer[0] * mesh.trainer[1]
    if ns + nt > len(devices):
        raise ValueError(f"plan check needs {ns + nt} devices, {len(devices)} present")
    train = train_memory(train_cfg, model_cfg, tuple(mesh.trainer), devices[ns : ns + nt])
    dtype_bytes = 2 if model_cfg.dtype == "bfloat16" else 4
    weights = sampler_weight_bytes(model_cfg, tuple(mesh.sampler), dtype_bytes)
    kv = kv_cache_bytes(model_cfg, sampler.num_slots, sampler.slot_len, tuple(mesh.sampler), dtype_bytes)
    compiled = decode_memory(model_cfg, sampler, tuple(mesh.sampler), devices[:ns])
    analytic = {"weights": weights, "kv_cache": kv, "total": weights + kv}
    return {"trainer": train, "sampler": {**compiled, "analytic": analytic}}
