"""Plan check: compile a config's train step and sampler programs for its meshes and report memory.

Nothing is allocated: parameters, optimizer state, micro-batches, weights and decode states are
ShapeDtypeStructs carrying their shardings, and XLA's compiled memory analysis gives the per-device
argument, output and temporary bytes. On a CPU-only machine the meshes are made of fake CPU devices (the
caller creates enough before JAX starts), so a user learns before launch whether a config fits.

Trainer: the train step's own jitted programs (`trainer.train_step.compile_abstract`): a micro-batch's
forward/backward into the gradient accumulator, and the optimizer update. The peak is the larger phase,
counting the optimizer state, which is live while micro-batches run. `trainer_state_bytes` counts what the
trainer's weights and optimizer from the declarations alone (no compile): masters, gradients and AdamW
moments of the trained tree, and with config.trainer.lora a frozen base in the compute dtype beside
adapters that alone have float32 masters, gradients and moments. `weight_sync_plan`: the predicted
seconds a version takes to reach the samplers (a LoRA run's: the adapters' bytes).

Attention on the target: the memory-efficient kernels cannot be compiled for a GPU or TPU here, so the
trainer is compiled with the splash kernel's own code in Pallas interpret mode, a flash-attention stand-in
with the same O(T) residuals. cuDNN (GPU "dot_product") takes packed rows in its packed layout (segment
lengths and offsets, `model.attention.packed_layout`): no [T, T] mask or bias, but its backward holds a
float32 workspace proportional to the segments a row may hold (measured on an H200,
`model.attention.cudnn_workspace_bytes`), added to the micro-batch phase. "reference" and "blocked" are
compiled as they are (the reference with float32 scores, T^2 x heads).

Headroom: a role's peak against the memory JAX may use on the target (device memory x the memory
fraction, `mem_fraction`); `headroom` refuses a role that leaves less than MIN_HEADROOM of it.

Sampler: every buffer a sampler device holds. The sampler's engine and the greedy eval engine are both
compiled, as `runtime.build.build_engines` builds them: with config.eval_weights="own" the eval engine
holds weights of its own (an evaluation runs beside sampling, with the version it evaluates), so the
weights count twice ("shared": once), plus each engine's decode state (KV cache and per-slot scalars).
A weight update briefly holds one more weight copy (the incoming sampler-layout copy while the decode
layout is built; the old layout is released first). A LoRA run's sampler (config.trainer.lora) also keeps
the base it received at start, receives only the adapters per version, and per config.sampler.lora_apply
carries them in its decode layout ("unmerged") or writes a merged copy per version ("merge"); see
`sampler_memory`. An analytic count (weights + slots x slot length x
layers x 2 x KV heads x head dim) is reported beside the compiled one as a cross-check.
`paged_kv_plan` sizes the paged KV cache an accelerator sampler uses (SamplerConfig.attention "auto" /
"paged_kernel") in the memory the compiled program leaves free: pages per device and the sequences that
run at once, at full length and on a long-tailed length mix under the sampler's admission rule.
`sharding_fallbacks` lists, per role, the dimensions the rules shard but the mesh axis does not divide
(replicated instead), so an uneven layout shows before launch rather than as memory on the device.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_async.model import ModelConfig, attention, param_specs
from jaxrl_async.model import lora as lora_lib
from jaxrl_async.runtime.compile_cache import program_key
from jaxrl_async.runtime.evaluation import eval_sampler_config
from jaxrl_async.sampler import Engine
from jaxrl_async.sampler.layout import CACHE_AXES
from jaxrl_async.sharding import SAMPLER_RULES, TRAINER_RULES, make_mesh
from jaxrl_async.trainer import TrainConfig
from jaxrl_async.trainer.train_step import compile_abstract

# XLA_PYTHON_CLIENT_MEM_FRACTION: launch/gpu_node.sh exports this value (a test keeps the two equal); a GPU
# process started without it preallocates JAX's default, 0.75. TPUs take the whole HBM.
GPU_NODE_MEM_FRACTION = 0.92
DEFAULT_MEM_FRACTION = {"gpu": 0.75, "tpu": 1.0, "cpu": 1.0}
# Refuse a layout whose compiled peak leaves less than this share of the usable memory: the CPU compile
# does not see the GPU/TPU compiler's own schedule and fusions, cuDNN/Pallas workspaces, the prefill
# outputs waiting to be inserted (up to 0.6 GiB for math_8b) or allocator fragmentation.
MIN_HEADROOM = 0.08
# Every program here is compiled only for XLA's memory analysis and never runs. Its buffer assignment is
# made before LLVM turns the program into machine code, so with LLVM's optimisations off the bytes are the
# same (every figure of the documented plan checks' reports compared, CONTRIBUTING.md "How long it takes")
# and a compile takes about half the CPU time.
MEMORY_ONLY_COMPILE = {"xla_backend_optimization_level": 0}


def compile_for_memory(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """`lowered` compiled for its memory analysis alone (MEMORY_ONLY_COMPILE)."""
    return lowered.compile(compiler_options=MEMORY_ONLY_COMPILE)


def mem_fraction(platform: str, env: dict[str, str]) -> tuple[float, str]:
    """(fraction of device memory JAX may use, where it came from) on `platform`, given the environment."""
    value = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if platform == "gpu" and value:
        try:
            frac = float(value)
        except ValueError:
            raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r}: not a number") from None
        if not 0 < frac <= 1:
            raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r}: must be in (0, 1]")
        return frac, "XLA_PYTHON_CLIENT_MEM_FRACTION"
    if platform == "gpu":
        return GPU_NODE_MEM_FRACTION, "launch/gpu_node.sh"
    return DEFAULT_MEM_FRACTION[platform], f"{platform} default"


# The config fields that move each role's peak, named in a refusal.
ROLE_FIELDS = {
    "trainer": "config.mesh.trainer, config.trainer.rows_per_micro, config.trainer.token_budget",
    "sampler": "config.mesh.sampler, config.sampler.num_slots, config.eval_slots, "
    "config.sampler.max_prompt_len + config.sampler.max_new_tokens",
}


def headroom(peaks: dict[str, float], mem_bytes: float, fraction: float, margin: float = MIN_HEADROOM):
    """Per role: the usable bytes (mem_bytes x fraction), the headroom the compiled peak leaves, and
    whether it is at least `margin` of the usable bytes. Returns (per-role dict, refusal messages)."""
    usable = mem_bytes * fraction
    out, refusals = {}, []
    gib = 2**30
    for role, peak in peaks.items():
        room = usable - peak
        ok = room >= margin * usable
        out[role] = {"usable_bytes": int(usable), "peak_bytes": int(peak), "headroom_bytes": int(room),
                     "headroom_fraction": room / usable, "ok": ok}  # fmt: skip
        if not ok:
            refusals.append(
                f"{role}: peak {peak / gib:.2f} GiB of {usable / gib:.2f} GiB usable "
                f"({mem_bytes / gib:.1f} GiB x memory fraction {fraction:.2f}) leaves {room / gib:.2f} GiB "
                f"({room / usable:.1%}), under the {margin:.0%} margin ({margin * usable / gib:.2f} GiB); "
                f"shrink {ROLE_FIELDS[role]}"
            )
    return out, refusals


def target_platform(hardware_name: str) -> str:
    """ "tpu", "gpu" or "cpu" for a jaxrl_async.perf.hardware preset name."""
    name = hardware_name.lower()
    if name.startswith("tpu"):
        return "tpu"
    return "cpu" if name in ("cpu", "this-cpu") else "gpu"


def _dtypes(tree) -> list[str]:
    return sorted({str(x.dtype) for x in jax.tree.leaves(tree) if len(x.shape)})


def trainer_attention(
    cfg: TrainConfig, model_cfg: ModelConfig, platform: str, trainer_shape: tuple[int, int] = (1, 1)
) -> dict:
    """Which attention the trainer runs on `platform` and what is compiled here for it. cuDNN takes packed
    rows as segment lengths and offsets (O(T) int32, nothing beside the stand-in), but its backward holds
    a float32 workspace that the stand-in lacks: `workspace_bytes` per device (a (fsdp, tensor) mesh splits
    the rows over fsdp and the heads over tensor), `model.attention.cudnn_workspace_bytes`."""
    target = attention.resolve(model_cfg.attention, platform)
    compute = cfg.compute_dtype or model_cfg.dtype
    if attention.uses_cudnn_packed(model_cfg.attention, compute, platform):
        fsdp = trainer_shape[0]
        sizes = TRAINER_RULES.mesh_sizes(trainer_shape)
        (heads,) = TRAINER_RULES.local_shape(("q_heads",), (model_cfg.n_heads,), sizes)
        rows = -(-cfg.rows_per_micro // fsdp)
        return {
            "target": "cudnn",
            "compiled_as": "splash",
            "max_segments": attention.max_segments(cfg.token_budget),
            "workspace_bytes": attention.cudnn_workspace_bytes(
                rows, heads, cfg.token_budget, model_cfg.head_dim
            ),
        }
    return {"target": target, "compiled_as": target, "workspace_bytes": 0}


def train_memory(
    cfg: TrainConfig,
    model_cfg: ModelConfig,
    trainer_shape: tuple[int, int],
    devices,
    platform: str = "cpu",
) -> dict:
    """Per-device bytes of the train step's compiled programs on a (fsdp, tensor) mesh.

    The top-level figures are the micro-batch program's (forward/backward into the gradient accumulator);
    `apply` is the optimizer update's, `prox_logprobs` the pi_prox forward's (minibatches > 1).
    `peak_estimate` is the largest phase, counting the optimizer state (live while micro-batches run).
    """
    mesh = make_mesh(trainer_shape, ("fsdp", "tensor"), devices)
    att = trainer_attention(cfg, model_cfg, platform, trainer_shape)
    compiled_as = model_cfg.replace(attention=att["compiled_as"])
    programs = compile_abstract(cfg, compiled_as, mesh, compile_for_memory)
    acc = compiled_memory(programs["accumulate"])
    apply = compiled_memory(programs["apply"])
    opt = programs["optimizer_state_bytes"]
    state = programs["state"]
    # cuDNN's workspace is live during a micro-batch's backward (the stand-in compiled here has none).
    phases = [acc["peak_estimate"] + opt + att["workspace_bytes"], apply["peak_estimate"]]
    prox = None
    if programs["logprobs"] is not None:  # minibatches > 1: the pi_prox forward before any update
        prox = compiled_memory(programs["logprobs"])
        phases.append(prox["peak_estimate"] + opt)
    return {
        **acc,
        "apply": apply,
        "prox_logprobs": prox,
        "optimizer_state_bytes": opt,
        "state": trainer_state_bytes(cfg, model_cfg, trainer_shape),  # analytic, beside the compiled
        "attention": att,
        "dtypes": {"params": _dtypes(state.params), "optimizer_state": _dtypes(state.opt_state)},
        "peak_estimate": max(phases),
    }


def trainer_state_bytes(cfg: TrainConfig, model_cfg: ModelConfig, trainer_shape: tuple[int, int]) -> dict:
    """Per-device bytes of the trainer's weights and optimizer, from the declarations under TRAINER_RULES
    (nothing compiles): `params`, the trained tree's masters (the whole model in model.param_dtype, or
    with config.trainer.lora the adapters in float32); `gradients`, the step's gradient accumulator (same
    dtype and layout; live while a step runs); `optimizer_state`, AdamW's two moments (same again; its step
    counters left out); `frozen`, a LoRA run's base in the compute dtype (a full run's is 0); `reference`,
    a full run's KL reference copy (trainer.kl_coef > 0; LoRA's is the base). Activations are not counted:
    `train_memory` compiles those."""
    sizes = TRAINER_RULES.mesh_sizes(trainer_shape)
    compute = cfg.compute_dtype or model_cfg.dtype

    def per_device(specs, dtype=None) -> int:
        leaves = jax.tree.leaves(specs, is_leaf=lambda x: hasattr(x, "logical_axes"))
        blocks = [(TRAINER_RULES.local_shape(s.logical_axes, s.shape, sizes), s.dtype) for s in leaves]
        return sum(int(np.prod(b)) * jnp.dtype(dtype or dt).itemsize for b, dt in blocks)

    base = param_specs(model_cfg)
    if cfg.lora.enabled:
        adapters = lora_lib.adapter_specs(model_cfg, cfg.lora)
        params, frozen, ref = per_device(adapters), per_device(base, compute), 0
    else:
        params, frozen = per_device(base, model_cfg.param_dtype), 0
        ref = per_device(base, compute) if cfg.kl_coef > 0 else 0
    out = {"params": params, "gradients": params, "optimizer_state": 2 * params, "frozen": frozen,
           "reference": ref}  # fmt: skip
    return {**out, "total": sum(out.values())}


def weight_sync_plan(model_cfg: ModelConfig, lora, mesh, hardware: str) -> dict:
    """Predicted seconds per version to move the weights (in the sampler's dtype) from the trainer to every
    sampler replica (jaxrl_async.perf.weight_sync: one rate per link, measured or from spec sheets). With
    `lora` (config.trainer.lora, enabled) a version moves only the adapters (the base moved once, at start).
    `mesh`: config.mesh."""
    from jaxrl_async.perf import weight_sync

    dtype = model_cfg.compute_copy().dtype
    if lora is not None and lora.enabled:
        nbytes = lora_lib.adapter_bytes(model_cfg, lora, dtype)
    else:
        nbytes = sampler_weight_bytes(model_cfg, (1, 1), jnp.dtype(dtype).itemsize)  # the whole model
    replicas = max(int(getattr(mesh, "sampler_replicas", 0) or 0), len(mesh.sampler_processes) or 1)
    nt, ns = mesh.trainer[0] * mesh.trainer[1], mesh.sampler[0] * mesh.sampler[1]
    link = weight_sync.link_for(hardware)
    return {
        "bytes": nbytes, "lora": bool(lora is not None and lora.enabled), "replicas": replicas,
        "link": link.name, "link_source": link.source,
        "seconds": weight_sync.sync_seconds(nbytes * replicas, link, nt, ns),
        "by_link": weight_sync.sync_report(nbytes, nt, ns, replicas),
    }  # fmt: skip


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
    data = sampler_shape[0]
    (heads,) = SAMPLER_RULES.local_shape(
        ("kv_heads",), (model_cfg.n_kv_heads,), SAMPLER_RULES.mesh_sizes(sampler_shape)
    )
    per_slot = 2 * model_cfg.n_layers * heads * model_cfg.head_dim * slot_len * dtype_bytes
    return -(-num_slots // data) * per_slot


def sampler_weight_bytes(
    model_cfg: ModelConfig, sampler_shape: tuple[int, int], dtype_bytes: int = 2, specs=None
) -> int:
    """Per-device sampler weight bytes under SAMPLER_RULES (replicated over data, split over tensor): of the
    model, or of `specs` (a ParamSpec tree, e.g. a LoRA's adapters)."""
    mesh_sizes = SAMPLER_RULES.mesh_sizes(sampler_shape)
    specs = param_specs(model_cfg) if specs is None else specs
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: hasattr(x, "logical_axes"))
    blocks = (SAMPLER_RULES.local_shape(s.logical_axes, s.shape, mesh_sizes) for s in leaves)
    return sum(int(np.prod(b)) for b in blocks) * dtype_bytes


@dataclasses.dataclass(frozen=True)
class _Buffer:
    """A buffer that is not a parameter, named by its shape and logical axes (for `sharding_fallbacks`)."""

    shape: tuple[int, ...]
    logical_axes: tuple[str | None, ...]


def sharding_fallbacks(model_cfg: ModelConfig, sampler_cfg: Any, mesh: Any) -> dict[str, list[dict]]:
    """Per role, the dimensions its rules shard but its mesh axis does not divide, so they are replicated
    (`sharding.Rules.fallbacks`): the trainer's parameters on (fsdp, tensor); the sampler's weights and a
    layer's slotted K or V buffer on (data, tensor). 8 KV heads on a tensor axis of 16 are right to
    replicate; a layout whose every weight falls back is probably not what was meant."""
    specs = param_specs(model_cfg)
    cache = _Buffer((sampler_cfg.num_slots, model_cfg.n_kv_heads, sampler_cfg.slot_len, model_cfg.head_dim),
                    CACHE_AXES)  # fmt: skip
    return {
        "trainer": TRAINER_RULES.fallbacks(specs, TRAINER_RULES.mesh_sizes(mesh.trainer)),
        "sampler": SAMPLER_RULES.fallbacks(
            {"params": specs, "kv_cache": cache}, SAMPLER_RULES.mesh_sizes(mesh.sampler)
        ),
    }


def fallback_line(role: str, fallbacks: list[dict]) -> str:
    """One line on a role's `sharding_fallbacks`, grouped by (logical axis, size, mesh axis)."""
    if not fallbacks:
        return f"  {role} sharding: every dimension the rules shard divides its mesh axis"
    groups: dict[tuple, list[str]] = {}
    for f in fallbacks:
        groups.setdefault((f["logical"], f["dim"], f["mesh_axis"], f["axis_size"]), []).append(f["leaf"])
    parts = [f"{logical} ({dim}) over {axis} ({size}) in {len(leaves)} leaves: {', '.join(leaves)}"
             for (logical, dim, axis, size), leaves in groups.items()]  # fmt: skip
    head = f"  {role} sharding, replicated where the rules shard (the axis does not divide): "
    return head + "; ".join(parts)


def _keyed(lowered, key: dict[str, float]):
    """Compiles `lowered`, recording in `key` what the executable store's key costs for it (a sampler
    process other than 0 with a local compile cache keys every program at every start,
    `compile_cache.program_key`): the seconds it takes, and the bytes of the StableHLO it hashes."""
    t = time.perf_counter()
    program_key(lowered, "")
    key["stablehlo_key_s"] = time.perf_counter() - t
    key["stablehlo_bytes"] = len(lowered.as_text().encode())
    return compile_for_memory(lowered)


def _generate_memory(model_cfg: ModelConfig, sampler_cfg: Any, mesh, lora=None):
    """(engine, compiled `generate` memory with accelerator temporaries) on `mesh`.

    XLA:CPU has no bfloat16 matmul: it converts bf16 operands (weights, KV cache) to f32 copies, which show
    up as temporaries an accelerator would not need. For a bf16 model the same step is therefore also
    compiled in f32, and its temporaries (f32 activations, an upper bound for bf16 ones) are reported as
    `temp_size_accelerator`; `peak_accelerator` = arguments + outputs - aliased + those temporaries.
    """
    key: dict[str, float] = {}
    keyed = lambda lowered: _keyed(lowered, key)  # noqa: E731
    engine = Engine(model_cfg, None, mesh, sampler_cfg, compile_fn=keyed, lora=lora)
    out = {**compiled_memory(engine.compile_generate()), **key}
    temps = out["temp_size"]
    if jnp.dtype(model_cfg.dtype) == jnp.bfloat16 or jnp.dtype(model_cfg.param_dtype) == jnp.bfloat16:
        f32 = dataclasses.replace(model_cfg, dtype="float32", param_dtype="float32")
        f32_engine = Engine(f32, None, mesh, sampler_cfg, compile_fn=compile_for_memory, lora=lora)
        temps = compiled_memory(f32_engine.compile_generate())["temp_size"]
    out["temp_size_accelerator"] = temps
    out["peak_accelerator"] = out["argument_size"] + out["output_size"] - out["alias_size"] + temps
    return engine, out


def decode_memory(model_cfg: ModelConfig, sampler_cfg: Any, sampler_shape: tuple[int, int], devices) -> dict:
    """Per-device bytes of the sampler's compiled `generate` on a (data, tensor) mesh over `devices`."""
    mesh = make_mesh(sampler_shape, ("data", "tensor"), devices)
    return _generate_memory(model_cfg, sampler_cfg, mesh)[1]


def sampler_memory(
    model_cfg: ModelConfig,
    sampler_cfg: Any,
    sampler_shape: tuple[int, int],
    devices,
    eval_slots: int = 64,
    eval_weights: str = "own",
    lora=None,
) -> dict:
    """Every buffer one sampler device holds (see the module doc), compiled and analytic.

    `model_cfg` is the sampler's: weights in the compute dtype (`ModelConfig.compute_copy`); `eval_slots`
    and `eval_weights` the run's config.eval_weights ("shared": one weight copy); `lora`: the run's
    config.trainer.lora when enabled (None otherwise), applied as `sampler_cfg.lora_apply` says.

    A LoRA run's receiver keeps the base it received at start in the sampler layout for the whole run
    (`lora_sync._Apply.base`: every version is applied to it), beside the engines' decode layouts. Per
    version it receives only the adapters (`received_per_version`); then with lora_apply="unmerged" the
    engines' layouts carry the adapters beside the base (compiled into `weights`) and an update lays out
    only them (transient: the incoming adapters + their new layout), and with "merge" the merged copy
    W + BA is written in the sampler layout before the engines lay it out (transient: a whole copy + the
    incoming adapters; the old layout is released first, as in a full run).
    """
    mesh = make_mesh(sampler_shape, ("data", "tensor"), devices)
    unmerged = lora if lora is not None and sampler_cfg.lora_apply == "unmerged" else None
    main, gen = _generate_memory(model_cfg, sampler_cfg, mesh, unmerged)
    eval_cfg = eval_sampler_config(sampler_cfg, sampler_shape[0], eval_slots)
    _, ev = _generate_memory(model_cfg, eval_cfg, mesh, unmerged)
    weights = main.weight_bytes_per_device()
    state, eval_state = gen["argument_size"] - weights, ev["argument_size"] - weights
    copies = 1 if eval_weights == "shared" else 2  # "own": the eval engine's copy of the weights
    weight_itemsize = jnp.dtype(model_cfg.param_dtype).itemsize
    an_w = sampler_weight_bytes(model_cfg, sampler_shape, weight_itemsize)  # the base, sampler layout
    if lora is None:
        kept, received, transient, an_adapters = 0, an_w, weights, 0
    else:
        an_adapters = sampler_weight_bytes(
            model_cfg, sampler_shape, weight_itemsize, lora_lib.adapter_specs(model_cfg, lora)
        )
        kept, received = an_w, an_adapters  # the received base, held all run; a version's adapters
        if unmerged is not None:  # the adapters' new decode layout (the compiled weights less the base's)
            base_layout = Engine(model_cfg, None, mesh, sampler_cfg).weight_bytes_per_device()
            transient = received + weights - base_layout
        else:
            transient = an_w + received  # the merged copy, beside the incoming adapters
    held = copies * weights + kept + state + eval_state
    temps = max(gen["temp_size_accelerator"], ev["temp_size_accelerator"])
    dtype_bytes = jnp.dtype(model_cfg.dtype).itemsize
    an_kv = kv_cache_bytes(model_cfg, sampler_cfg.num_slots, sampler_cfg.slot_len, sampler_shape, dtype_bytes)
    an_ev = kv_cache_bytes(model_cfg, eval_cfg.num_slots, eval_cfg.slot_len, sampler_shape, dtype_bytes)
    an_layout = an_w + (an_adapters if unmerged is not None else 0)  # one engine's decode-layout weights
    return {
        "weights": weights,
        "weight_copies": copies,
        "lora_apply": None if lora is None else sampler_cfg.lora_apply,
        "received_base": kept,
        "received_per_version": received,
        "decode_state": state,
        "eval_decode_state": eval_state,
        "held": held,
        "temp_size_accelerator": temps,
        "update_transient": transient,
        "peak": held + max(temps, transient),
        "eval_slots": eval_cfg.num_slots,
        "generate": gen,
        "eval_generate": ev,
        "dtypes": _dtypes(main.expected_params),
        "analytic": {
            "weights": an_layout,
            "adapters": an_adapters,
            "received_base": kept,
            "kv_cache": an_kv,
            "eval_kv_cache": an_ev,
            "total": copies * an_layout + kept + an_kv + an_ev,
        },
    }


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


def plan_check(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    sampler: Any,
    mesh: Any,
    platform: str = "cpu",
    eval_slots: int = 64,
    eval_weights: str = "own",
) -> dict:
    """Memory per device for the trainer and the sampler, both from compiled programs.

    Args:
      model_cfg: the model (param_dtype = the trainer's master weights; dtype = compute and sampler).
      train_cfg: TrainConfig of the run.
      sampler: SamplerConfig of the run (num_slots, slot_len).
      mesh: object with `sampler` (data, tensor) and `trainer` (fsdp, tensor) shapes.
      platform: the target ("gpu", "tpu" or "cpu"): decides which attention the trainer runs.
      eval_slots: config.eval_slots (the greedy eval engine's slots).
      eval_weights: config.eval_weights (whether the eval engine holds a weight copy of its own).
    """
    devices = jax.devices()
    ns = mesh.sampler[0] * mesh.sampler[1]
    nt = mesh.trainer[0] * mesh.trainer[1]
    if ns + nt > len(devices):
        raise ValueError(f"plan check needs {ns + nt} devices, {len(devices)} present")
    train = train_memory(train_cfg, model_cfg, tuple(mesh.trainer), devices[ns : ns + nt], platform)
    lora = train_cfg.lora if train_cfg.lora.enabled else None
    s_devices = devices[:ns]
    sampler_mem = sampler_memory(
        model_cfg.compute_copy(), sampler, tuple(mesh.sampler), s_devices, eval_slots, eval_weights, lora
    )
    return {"trainer": train, "sampler": sampler_mem}
