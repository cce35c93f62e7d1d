"""LoRA in the sampler, merged against unmerged, and adapter-only sync against full sync (one process).

  python -m benchmarks.bench_lora [--preset tiny] [--rank 8] [--reps 5] [--json-out FILE]

Per policy version (median over --reps, the variants interleaved):
  - full: the whole model synced (`WeightSync`) and laid out (`Engine.update_params`);
  - merge: the adapters synced (`LoraWeights.publish`), W + (alpha/r)·A·B merged into the sampler's copy
    of the base and laid out (`Engine.update_params`);
  - unmerged: the adapters synced and only they laid out (`Engine.update_adapters`).
Decode: greedy generation of the same prompts by a merged engine and an unmerged one (tokens per second,
median over --reps runs of the whole batch, interleaved). Prints the CPU model and the load average: on a
shared machine the figures move with the load.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import numpy as np
from absl import flags

from benchmarks.machine import cpu_model
from jaxrl_async.cli import run_command
from jaxrl_async.model import init_params, presets
from jaxrl_async.model import lora as lora_lib
from jaxrl_async.runtime.lora_sync import LoraWeights, tree_bytes
from jaxrl_async.runtime.weight_sync import WeightSync
from jaxrl_async.sampler import Engine, Request, SamplerConfig, SamplerLoop
from jaxrl_async.sharding import TRAINER_RULES, make_mesh

_PRESET = flags.DEFINE_string("preset", "tiny", "model shape (jaxrl_async.model.presets)")
_RANK = flags.DEFINE_integer("rank", 8, "LoRA rank (every projection)", lower_bound=1)
_REPS = flags.DEFINE_integer("reps", 5, "timed repetitions (the median is reported)", lower_bound=1)
_JSON_OUT = flags.DEFINE_string("json-out", "", "also write the JSON here")
_UNMERGED_FIRST = flags.DEFINE_bool("unmerged-first", False, "decode: the unmerged engine first each round")


def _interleaved(fns: dict, reps: int) -> dict:
    """Median seconds of each of `fns`, run in turn (A, B, C, A, B, C, ...) after one untimed call each:
    on a shared machine the load drifts, and interleaving gives every variant the same drift."""
    for fn in fns.values():
        fn()  # compiles
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _decode(engine, prompts, count: list):
    def run():
        loop = SamplerLoop(engine)
        for i, p in enumerate(prompts):
            loop.add_request(Request(i, p, n_samples=1, seed=i))
        count[0] = sum(len(c.tokens) for c in loop.run())

    return run


def main(argv) -> None:
    del argv
    reps = _REPS.value
    cfg = presets.get(_PRESET.value, dtype="float32", param_dtype="float32")
    lora = lora_lib.LoraConfig(enabled=True, rank=_RANK.value, alpha=2.0 * _RANK.value, init="normal")
    devices = jax.devices()
    t_mesh = make_mesh((1, 1), ("fsdp", "tensor"), devices[:1])
    s_mesh = make_mesh((1, 1), ("data", "tensor"), devices[1:2] or devices[:1])
    base = init_params(cfg, jax.random.key(0), t_mesh, TRAINER_RULES)
    adapters = lora_lib.init_adapters(cfg, lora, jax.random.key(1))
    adapters = jax.device_put(adapters, t_mesh.devices.flat[0])
    scfg = dict(num_slots=16, max_prompt_len=16, max_new_tokens=32, steps_per_call=8, temperature=0.0,
                attention="xla", linear="xla")  # fmt: skip
    res = {"preset": _PRESET.value, "params": cfg.num_params, "rank": lora.rank, "cpu": cpu_model(),
           "loadavg_before": os.getloadavg()[0], "devices": len(devices)}  # fmt: skip

    full_sync = WeightSync(cfg, s_mesh)
    copy = full_sync(base)
    full_engine = Engine(cfg, copy, s_mesh, SamplerConfig(**scfg))

    def full_version():
        full_engine.update_params(full_sync(base), 1)
        jax.block_until_ready(full_engine.decode_params)

    merge_w = LoraWeights(cfg, lora, s_mesh, base, apply="merge")
    merged_engine = Engine(cfg, merge_w.receive(merge_w.publish(0, adapters)), s_mesh, SamplerConfig(**scfg))

    def merge_version():
        merged_engine.update_params(merge_w.receive(merge_w.publish(1, adapters)), 1)
        jax.block_until_ready(merged_engine.decode_params)

    un_w = LoraWeights(cfg, lora, s_mesh, base, apply="unmerged")
    un_engine = Engine(cfg, un_w.receive(un_w.publish(0, adapters)), s_mesh,
                       SamplerConfig(**scfg, lora_apply="unmerged"), lora=lora)  # fmt: skip

    def unmerged_version():
        message = un_w.publish(1, adapters)
        un_engine.update_adapters(message.params, 1)
        jax.block_until_ready(un_engine.decode_params)

    res["bytes_per_version"] = {"full": tree_bytes(copy), "adapters": merge_w.last_bytes}
    res["seconds_per_version"] = _interleaved(
        {"full": full_version, "merge": merge_version, "unmerged": unmerged_version}, reps
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, size=int(rng.integers(4, 17))).tolist() for _ in range(32)]
    counts = {"merge": [0], "unmerged": [0]}
    runs = {"merge": _decode(merged_engine, prompts, counts["merge"]),
            "unmerged": _decode(un_engine, prompts, counts["unmerged"])}  # fmt: skip
    if _UNMERGED_FIRST.value:  # which variant runs first in each round (a check for order effects)
        runs = dict(reversed(list(runs.items())))
    decode_s = _interleaved(runs, reps)
    res["decode_tokens_per_s"] = {name: counts[name][0] / decode_s[name] for name in decode_s}
    res["loadavg_after"] = os.getloadavg()[0]
    print(json.dumps(res, indent=1))
    s, d, b = res["seconds_per_version"], res["decode_tokens_per_s"], res["bytes_per_version"]
    print(f"{res['cpu']}; load average {res['loadavg_before']:.1f} -> {res['loadavg_after']:.1f}")
    ratio = b["full"] / b["adapters"]
    print(f"bytes per version: full {b['full']:,}, adapters {b['adapters']:,} ({ratio:.0f}x fewer)")
    print(f"seconds per version: full {s['full'] * 1e3:.1f} ms, merge {s['merge'] * 1e3:.1f} ms, "
          f"unmerged {s['unmerged'] * 1e3:.1f} ms")  # fmt: skip
    print(f"decode tokens/s: merge {d['merge']:.0f}, unmerged {d['unmerged']:.0f}")
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(res, f, indent=1)


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m benchmarks.bench_lora`
    run()
