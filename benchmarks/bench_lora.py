"""LoRA in the sampler, merged against unmerged, and adapter-only sync against full sync.

  python -m benchmarks.bench_lora [--preset tiny] [--rank 8] [--reps 5] [--json-out FILE]
  python -m benchmarks.bench_lora --mode=sync --preset llama_100m --rank 16 [--reps 5]
  python -m benchmarks.bench_lora --mode=plan [--rank 16]

--mode=sampler (the default), per policy version (median over --reps, the variants interleaved):
Per policy version (median over --reps, the variants interleaved):
  - full: the whole model synced (`WeightSync`) and laid out (`Engine.update_params`);
  - merge: the adapters synced (`LoraWeights.publish`), W + (alpha/r)·A·B merged into the sampler's copy
    of the base and laid out (`Engine.update_params`);
  - unmerged: the adapters synced and only they laid out (`Engine.update_adapters`).
Decode: greedy generation of the same prompts by a merged engine and an unmerged one (tokens per second,
median over --reps runs of the whole batch, interleaved).

--mode=sync: bytes and seconds per version, the whole model against the adapters only, side by side in one
run: in one process (trainer device 0 -> sampler device 1, `WeightSync` against `LoraWeights`, each to
the last byte on the sampler's device, interleaved) and across two processes on this host (one CPU device
each; `TransferPublisher`/`TransferReceiver` against `LoraPublisher`/`LoraReceiver`, alternating per
version, over shared memory and over the transfer server: benchmarks/lora_sync_worker.py). The bytes are
the receiver's count.

--mode=plan: no measurement: the plan check's predictions (`runtime.plan_check.weight_sync_plan`,
`trainer_state_bytes`) for Qwen3-8B on configs/math_8b.py's layouts (TPU v5p pod, 8 x H100 node), full
fine-tuning against LoRA of --rank on every projection: seconds per version over each link and the
trainer's per-device weights and optimizer state.

Prints the CPU model and the load average: on a shared machine the figures move with the load.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
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

_MODE = flags.DEFINE_enum("mode", "sampler", ["sampler", "sync", "plan"], "what to measure (see above)")
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
    if _MODE.value == "sync":
        return sync_main()
    if _MODE.value == "plan":
        return plan_main()
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


def _one_process_sync(cfg, lora, reps: int) -> dict:
    """Trainer device 0 -> sampler device 1 (a CPU host's fake devices): whole model vs adapters only."""
    devices = jax.devices()
    t_mesh = make_mesh((1, 1), ("fsdp", "tensor"), devices[:1])
    s_mesh = make_mesh((1, 1), ("data", "tensor"), devices[1:2] or devices[:1])
    base = init_params(cfg, jax.random.key(0), t_mesh, TRAINER_RULES)
    adapters = jax.device_put(lora_lib.init_adapters(cfg, lora, jax.random.key(1)), devices[0])
    full = WeightSync(cfg, s_mesh)
    t0 = time.perf_counter()
    low = LoraWeights(cfg, lora, s_mesh, base)  # the base moves here, once
    base_s = time.perf_counter() - t0
    version = [0]

    def adapters_only():
        version[0] += 1
        jax.block_until_ready(low.receive(low.publish(version[0], adapters)))

    whole = lambda: jax.block_until_ready(full(base))  # noqa: E731
    seconds = _interleaved({"full": whole, "adapters": adapters_only}, reps)
    return {"devices": [str(d) for d in (t_mesh.devices.flat[0], s_mesh.devices.flat[0])],
            "bytes": {"full": tree_bytes(full(base)), "adapters": low.last_bytes},
            "seconds": seconds, "base_bytes": low.base_bytes, "base_s": base_s}  # fmt: skip


def _two_process_sync(transport: str, reps: int) -> dict:
    """benchmarks/lora_sync_worker.py as processes 0 and 1 of a localhost cluster; medians of versions
    1..reps (version 0 compiles, and brings the LoRA base)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per process
    env.update(PYTHONPATH=repo, JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.json")
        args = [out, transport, _PRESET.value, str(_RANK.value), str(reps)]
        cmd = [sys.executable, "-m", "benchmarks.lora_sync_worker"]
        procs = [subprocess.Popen([*cmd, str(i), str(port), *args], cwd=repo, env=env) for i in range(2)]
        codes = [p.wait(timeout=1800) for p in procs]
        if codes != [0, 0]:
            raise RuntimeError(f"lora_sync_worker ({transport}) exited with {codes}")
        with open(out) as f:
            res = json.load(f)
    summary = {"paths": res["paths"], "base_bytes": res["base_bytes"]}
    for name, t in res["times"].items():
        pub, rec = t["publish_s"][1:], t["receive_s"][1:]
        summary[name] = {"bytes": sorted(set(t["bytes"][1:])), "publish_s": statistics.median(pub),
                         "receive_s": statistics.median(rec),
                         "seconds": statistics.median([a + b for a, b in zip(pub, rec, strict=True)]),
                         "first_version_s": t["publish_s"][0] + t["receive_s"][0],
                         "first_version_bytes": t["bytes"][0]}  # fmt: skip
    return summary


def sync_main() -> None:
    reps = _REPS.value
    cfg = presets.get(_PRESET.value, dtype="float32", param_dtype="float32")
    lora = lora_lib.LoraConfig(enabled=True, rank=_RANK.value, alpha=2.0 * _RANK.value, init="normal")
    res = {"mode": "sync", "preset": _PRESET.value, "params": cfg.num_params, "rank": lora.rank,
           "adapter_params": lora_lib.adapter_params(cfg, lora), "cpu": cpu_model(),
           "loadavg_before": os.getloadavg()[0], "reps": reps}  # fmt: skip
    res["one_process"] = _one_process_sync(cfg, lora, reps)
    res["two_processes"] = {t: _two_process_sync(t, reps) for t in ("auto", "transfer")}
    res["loadavg_after"] = os.getloadavg()[0]
    print(json.dumps(res, indent=1))
    print(f"{res['cpu']}; load average {res['loadavg_before']:.1f} -> {res['loadavg_after']:.1f}; "
          f"{_PRESET.value} ({cfg.num_params / 1e6:.0f}M params, float32), LoRA rank {lora.rank} on every "
          "projection")
    one = res["one_process"]
    rows = [("one process, device to device", one["bytes"]["full"], one["seconds"]["full"],
             one["bytes"]["adapters"], one["seconds"]["adapters"])]  # fmt: skip
    for r in res["two_processes"].values():
        path = "shared memory" if r["paths"]["full"] == "shm" else "transfer server"
        rows.append((f"two processes, {path}", r["full"]["bytes"][0], r["full"]["seconds"],
                     r["adapters"]["bytes"][0], r["adapters"]["seconds"]))  # fmt: skip
    head = ("path", "full bytes", "full s", "adapter bytes", "adapter s", "bytes x")
    print("{:<36} {:>14} {:>9} {:>14} {:>10} {:>8}".format(*head))
    for name, fb, fs, ab, as_ in rows:
        print(f"{name:<36} {fb:>14,} {fs:>9.4f} {ab:>14,} {as_:>10.5f} {fb / ab:>8.0f}")
    print(f"the LoRA base, once: {one['base_bytes']:,} bytes")
    _write(res)


def plan_main() -> None:
    """The plan check's predictions for Qwen3-8B (configs/math_8b.py), full vs LoRA (no compile)."""
    from configs import math_8b as module  # python -m from the repository root, as every benchmark
    from jaxrl_async.run_config import memory_sections
    from jaxrl_async.runtime.plan_check import trainer_state_bytes, weight_sync_plan

    rank = _RANK.value
    res = {"mode": "plan", "model": "qwen3-8b", "rank": rank, "layouts": {}}
    for layout, hardware in (("v5p", "tpu-v5p"), ("h100", "h100")):
        config = module.get_config(layout)
        m = config.model
        model = presets.get("qwen3-8b", dtype=m.dtype, param_dtype=m.param_dtype, attention=m.attention)
        out = {"hardware": hardware, "trainer_mesh": list(config.mesh.trainer)}
        for name, enabled in (("full", False), ("lora", True)):
            config.trainer.lora.enabled, config.trainer.lora.rank = enabled, rank
            config.trainer.lora.alpha = 2.0 * rank
            train_cfg = memory_sections(config.to_dict())["trainer"]
            out[name] = {"sync": weight_sync_plan(model, train_cfg.lora, config.mesh, hardware),
                         "trainer_state": trainer_state_bytes(train_cfg, model, tuple(config.mesh.trainer))}
        res["layouts"][layout] = out
    print(json.dumps(res, indent=1))
    gib = 2**30
    for layout, out in res["layouts"].items():
        print(f"configs/math_8b.py:{layout} ({out['hardware']}), Qwen3-8B, LoRA rank {rank} on every "
              "projection:")
        for name in ("full", "lora"):
            ws, st = out[name]["sync"], out[name]["trainer_state"]
            shown = ("ici", "dcn", "nvlink")
            links = ", ".join(f"{k} {v:.3g} s" for k, v in ws["by_link"].items() if k in shown)
            print(f"  {name:>4}: {ws['bytes'] / 1e6:,.1f} MB per version x {ws['replicas']} replica(s): "
                  f"{ws['seconds']:.3g} s over {ws['link']} ({links}); trainer per device "
                  f"({tuple(out['trainer_mesh'])}): masters {st['params'] / gib:.2f} GiB + gradients "
                  f"{st['gradients'] / gib:.2f} GiB + AdamW "
                  f"{st['optimizer_state'] / gib:.2f} GiB + frozen base {st['frozen'] / gib:.2f} GiB = "
                  f"{st['total'] / gib:.2f} GiB")  # fmt: skip
    _write(res)


def _write(res: dict) -> None:
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(res, f, indent=1)


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m benchmarks.bench_lora`
    run()
