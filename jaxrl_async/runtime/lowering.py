"""A run's accelerator programs lowered for their target here, on CPU devices: what a GPU or TPU would run.

`lower_programs` builds, for a config's meshes and a target platform ("gpu" or "tpu"), the programs a run
executes, as `jax.stages.Lowered` (StableHLO for the target, with its kernels' custom calls), without
compiling them or allocating anything:
  - the train step (`trainer.train_step.lower_abstract`): a micro-batch's forward/backward, the optimizer
    update and the pi_prox forward (decoupled PPO with minibatches > 1);
  - the sampler engine's weight-layout conversion, prefill, insert and `generate` over the paged cache, and
    the greedy evaluation engine's (`sampler.Engine.lower_for`);
  - the weight sync's reshard from the trainer's layout to the sampler's (`shard_routes.ShardRoutes`).
Kernel choices follow ModelConfig.platform, set here to the target, so every choice is the target's (the
paged kernel, cuDNN or splash attention), not the CPU's the programs are built on.

What it catches: shapes, BlockSpecs, `shard_map` specs and wrapper errors in code that CPU runs never
execute (the Triton and Mosaic kernels are only interpreted there, and cuDNN never runs). What it cannot:
the device compiler's own errors (Triton, Mosaic and XLA:GPU/TPU passes run at compile time), memory and
speed. `paged_table_smem_bytes` is the one kernel limit that is plain arithmetic: a TPU paged kernel holds
its call's page table in scalar memory (the engine refuses a layout over budget, `sampler.paged`).
"""

from __future__ import annotations

import base64
import re
import time

import jax
import jax.numpy as jnp

from jaxrl_async.model import ModelConfig, abstract_params, param_shardings
from jaxrl_async.runtime.evaluation import eval_sampler_config
from jaxrl_async.runtime.shard_routes import ShardRoutes
from jaxrl_async.sampler import Engine, paged
from jaxrl_async.sharding import SAMPLER_RULES, TRAINER_RULES, make_mesh
from jaxrl_async.trainer.train_step import lower_abstract

# Target platform -> the name JAX lowers for.
LOWERING_PLATFORM = {"gpu": "cuda", "tpu": "tpu"}
# Custom-call targets that show a target's kernel in lowered text: Pallas on Triton (the paged decode
# kernel), cuDNN's fused attention (training and prefill on a GPU), Mosaic (every Pallas TPU kernel: paged
# decode, splash attention).
TRITON = ("__gpu$xla.gpu.triton", "xla.gpu.triton")
CUDNN = ("__cudnn$fmha",)
MOSAIC = ("tpu_custom_call",)



def custom_calls(lowered) -> set[str]:
    """Custom-call targets in a lowered program's text (StableHLO)."""
    return set(re.findall(r"custom_call\s*@([\w$.\-]+)", lowered.as_text()))


def has_call(calls: set[str], names: tuple[str, ...]) -> bool:
    """Whether any target in `calls` starts with one of `names`."""
    return any(c.startswith(n) for c in calls for n in names)


def mosaic_grids(lowered) -> list[tuple[str, tuple[int, ...]]]:
    """(kernel name, grid) of each Mosaic kernel call in a program lowered for tpu: the kernel bodies,
    serialized MLIR in the calls' configs, decoded with the TPU dialect jaxlib ships. The TPU paged
    kernel's grid leads with its core count: 2 where it splits over a megacore chip's two TensorCores."""
    from jax._src.lib import tpu
    from jax._src.lib.mlir import ir

    grids = []
    for call in lowered.as_text().split("@tpu_custom_call")[1:]:
        body = re.search(r"body\\22: \\22([A-Za-z0-9+/=]+)", call).group(1)
        name = re.search(r'kernel_name = "(\w+)"', call)
        with ir.Context() as ctx:
            ctx.allow_unregistered_dialects = True  # the "stable_mosaic" version wrapper
            tpu.register_dialect(ctx)
            text = str(ir.Module.parse(base64.b64decode(body)))
        bounds = re.search(r"iteration_bounds = array<i64: ([\d, ]+)>", text).group(1)
        grids.append((name.group(1) if name else "", tuple(int(b) for b in bounds.split(","))))
    return grids


def paged_table_smem_bytes(engine: Engine) -> int:
    """Scalar-memory bytes of the page table (and lengths) one paged-kernel call holds on a device: its data
    shard's slots x (table width + 1), int32, plus the ragged kernel's query offsets and write destinations
    (`sampler.paged.table_smem_bytes`; the engine refuses a TPU layout over `paged.SMEM_TABLE_SHARE` of
    `paged.TPU_SMEM_BYTES`)."""
    lay = engine.spec.cache.layout
    return paged.table_smem_bytes(engine.cfg.num_slots // lay.data, lay.width, lay.tpu_kernel)


def lower_programs(
    model_cfg: ModelConfig,
    train_cfg,
    sampler_cfg,
    sampler_shape: tuple[int, int],
    trainer_shape: tuple[int, int],
    platform: str,
    eval_slots: int,
    devices=None,
) -> dict:
    """The run's programs lowered for `platform` ("gpu" or "tpu").

    Meshes: the sampler's over the first data x tensor of `devices` (default all), the trainer's over the
    first fsdp x tensor (programs are lowered one at a time, so the two may share devices). Fake CPU
    devices serve: a `jax.sharding.AbstractMesh` would not, as cuDNN's partitioning rule needs devices.
    The reshard lowered is the one-process `WeightSync`'s; a layout of several processes (math_8b's v5p
    pod) cuts the same per-device pieces in `TransferPublisher`, which is not lowered here.

    Returns:
      {"programs": {name: jax.stages.Lowered}, "seconds": {group: seconds to trace and lower it},
       "engines": {"sampler": Engine, "eval": Engine} (compile-only, for their layouts)}.
    """
    if platform not in LOWERING_PLATFORM:
        raise ValueError(f"platform {platform!r} not in {tuple(LOWERING_PLATFORM)}")
    target = (LOWERING_PLATFORM[platform],)
    devices = list(jax.devices() if devices is None else devices)
    model_cfg = model_cfg.replace(platform=platform)
    nt, ns = trainer_shape[0] * trainer_shape[1], sampler_shape[0] * sampler_shape[1]
    if max(nt, ns) > len(devices):
        raise ValueError(f"lowering needs {max(nt, ns)} devices, {len(devices)} present")
    trainer_mesh = make_mesh(trainer_shape, ("fsdp", "tensor"), devices[:nt])
    sampler_mesh = make_mesh(sampler_shape, ("data", "tensor"), devices[:ns])
    programs, seconds = {}, {}

    def timed(group: str, lower):
        t = time.perf_counter()
        for name, lowered in lower().items():
            if lowered is not None:
                programs[f"{group}/{name}"] = lowered
        seconds[group] = time.perf_counter() - t

    def train():
        out = lower_abstract(train_cfg, model_cfg, trainer_mesh, target)
        return {name: out[name] for name in ("accumulate", "apply", "logprobs")}

    timed("train", train)
    engines = {"sampler": Engine(model_cfg.compute_copy(), None, sampler_mesh, sampler_cfg)}
    timed("sampler", lambda: engines["sampler"].lower_for(target))
    eval_cfg = eval_sampler_config(sampler_cfg, sampler_shape[0], eval_slots)
    engines["eval"] = Engine(model_cfg.compute_copy(), None, sampler_mesh, eval_cfg)
    timed("eval", lambda: {"generate": engines["eval"].lower_for(target)["generate"]})
    timed("weight_sync", lambda: _reshard(model_cfg, trainer_mesh, sampler_mesh, target))
    return {"programs": programs, "seconds": seconds, "engines": engines}


def _reshard(model_cfg: ModelConfig, trainer_mesh, sampler_mesh, target: tuple[str, ...]) -> dict:
    """The weight sync's cut and placement programs, trainer layout (master dtype) -> sampler layout (the
    compute dtype), as `runtime.weight_sync.WeightSync` builds them."""
    src = jax.tree.leaves(param_shardings(model_cfg, trainer_mesh, TRAINER_RULES))
    dst = jax.tree.leaves(param_shardings(model_cfg, sampler_mesh, SAMPLER_RULES))
    shapes = [s.shape for s in jax.tree.leaves(abstract_params(model_cfg, trainer_mesh, TRAINER_RULES))]
    routes = ShardRoutes(shapes, src, dst, model_cfg.dtype)
    return routes.lower_for([jnp.dtype(model_cfg.param_dtype)] * len(shapes), target)

