"""Weight-sync speed in one process: fp32 masters -> the sampler copy (cast, transfer) -> the engine layout.

  python -m benchmarks.bench_sync_one_process --preset qwen2.5-1.5b --dtype bfloat16 [--json-out FILE]

Times, per layout, the median over `--reps` syncs of
  - `WeightSync`: the cast of float32 masters to `--dtype` on the trainer's devices and the
    `jax.device_put` into the sampler's sharding (what the trainer thread pays per policy version);
  - `Engine.update_params`: validation and the conversion into the decode layout on the sampler's devices.
Layouts: "colocated" (trainer and sampler meshes on the same first device, as on one GPU) and, with two or
more devices, "two_meshes" (trainer on device 0, sampler on device 1). GB/s counts the bytes of the
sampler's copy.
"""

from __future__ import annotations

import json
import statistics
import time

import jax
from absl import flags

from jaxrl_async.cli import run_command
from jaxrl_async.model import init_params, presets
from jaxrl_async.runtime.weight_sync import WeightSync
from jaxrl_async.sampler import Engine, SamplerConfig
from jaxrl_async.sharding import TRAINER_RULES, make_mesh

_PRESET = flags.DEFINE_string("preset", "qwen2.5-1.5b", "model shape (jaxrl_async.model.presets)")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "the sampler's weight dtype (masters: float32)")
_REPS = flags.DEFINE_integer("reps", 5, "timed syncs per layout (the median is reported)", lower_bound=1)
_JSON_OUT = flags.DEFINE_string("json-out", "", "also write the JSON here")


def _median_seconds(fn, reps: int) -> float:
    fn()  # compiles
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_layout(model_cfg, trainer_dev, sampler_dev, dtype: str, reps: int) -> dict:
    trainer = make_mesh((1, 1), ("fsdp", "tensor"), [trainer_dev])
    sampler = make_mesh((1, 1), ("data", "tensor"), [sampler_dev])
    masters = init_params(model_cfg, jax.random.key(0), trainer, TRAINER_RULES)
    sync = WeightSync(model_cfg, sampler, dtype=dtype)
    copy = sync(masters)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(copy))
    sync_s = _median_seconds(lambda: sync(masters), reps)
    engine = Engine(sync.sampler_cfg, copy, sampler, SamplerConfig(num_slots=1, max_prompt_len=16))

    def update():
        engine.update_params(copy, 1)
        jax.block_until_ready(engine.decode_params)

    update_s = _median_seconds(update, reps)
    return {
        "bytes": nbytes,
        "sync_s": sync_s,
        "sync_GBps": nbytes / sync_s / 1e9,
        "engine_update_s": update_s,
        "total_s": sync_s + update_s,
    }


def main(argv) -> None:
    del argv
    preset, dtype, reps = _PRESET.value, _DTYPE.value, _REPS.value
    model_cfg = presets.get(preset, dtype=dtype, param_dtype="float32")
    devices = jax.devices()
    res = {
        "preset": preset,
        "params": model_cfg.num_params,
        "dtype": dtype,
        "device_kind": devices[0].device_kind,
        "colocated": bench_layout(model_cfg, devices[0], devices[0], dtype, reps),
    }
    if len(devices) > 1:
        res["two_meshes"] = bench_layout(model_cfg, devices[0], devices[1], dtype, reps)
    print(json.dumps(res, indent=1))
    for name in ("colocated", "two_meshes"):
        if name in res:
            r = res[name]
            print(
                f"{name}: {r['bytes'] / 1e9:.2f} GB in {r['sync_s'] * 1e3:.1f} ms "
                f"({r['sync_GBps']:.1f} GB/s), engine update {r['engine_update_s'] * 1e3:.1f} ms"
            )
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(res, f, indent=1)


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m benchmarks.bench_sync_one_process`
    run()
