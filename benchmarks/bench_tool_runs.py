"""Sync vs async runs of the calculator task with tool latency injected (issue 55: async should hide the
tool latency that sync pays in full).

  JAX_PLATFORMS=cpu python -m benchmarks.bench_tool_runs [--latencies_ms 0,50,500] [--steps 8]

For each latency, a sync run and an async run (η = the config's) of configs/calc_tool.py, one after the
other, each `jaxrl-run` in a process of its own with the same flags but `--config.mode`. Every run's
environment is `benchmarks.tool_latency_env:slow_calls`: the config's `ToolEnv`, each tool call first
waiting the injected latency (`JAXRL_BENCH_TOOL_LATENCY_MS` in the run's environment) while its episode's
slot stays parked. No evaluation during RL (`eval_every=0`). `env.tool_workers` is `--tool_workers`
(default: one thread per sampler slot, as for a remote tool that serves calls concurrently; the config's
4 threads would make the pool the bottleneck of both modes at 500 ms).

The first run does the supervised warm start (the environment's name is part of its cache key) and caches
it; the others load it. Read back from each run: summary.json (trained tokens/s over the RL wall, and
steady after the first fifth of the steps; RL wall seconds, warm start and compiles before it excluded)
and TensorBoard (env/tool_calls, env/parked_slot_fraction: the actors' share of dispatched slot-steps held
by parked slots). Prints a table and the async/sync ratio per latency, with the CPU model and load average.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

from absl import app, flags

from benchmarks.machine import cpu_model
from benchmarks.tool_latency_env import LATENCY_VAR
from jaxrl_async.cli import REPO, module_command, run_logged
from jaxrl_async.runtime.metrics import read_scalars

FLAGS = flags.FLAGS
flags.DEFINE_list("latencies_ms", ["0", "50", "500"], "injected latency of one tool call, ms")
flags.DEFINE_list("modes", ["sync", "async"], "run modes, each at every latency")
flags.DEFINE_integer("steps", 8, "RL steps per run")
flags.DEFINE_integer("tool_workers", 128, "config.env.tool_workers of every run")
flags.DEFINE_integer("eval_prompts", 100, "held-out prompts of the warm start's checks")
flags.DEFINE_string("keep", "", "keep workdirs and logs here (default: a temporary directory)")
flags.DEFINE_string("json_out", None, "write the results here as JSON")


def run_flags(workdir: str, mode: str, cache: str) -> list[str]:
    values = {
        "workdir": workdir,
        "mode": mode,
        "total_steps": FLAGS.steps,
        "eval_every": 0,
        "eval_prompts": FLAGS.eval_prompts,
        "compile_cache_dir": cache,  # later runs skip most compiles (the RL wall excludes them anyway)
        "env.environment": "benchmarks.tool_latency_env:slow_calls",
        "env.tool_workers": FLAGS.tool_workers,
    }
    return [f"--config={os.path.join(REPO, 'configs', 'calc_tool.py')}"] + [
        f"--config.{k}={v}" for k, v in values.items()
    ]


def run_one(root: str, mode: str, latency_ms: float) -> dict:
    name = f"{mode}_{latency_ms:g}ms"
    workdir = os.path.join(root, name)
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run: nothing to resume from
    os.environ[LATENCY_VAR] = f"{latency_ms:g}"  # the run's environment (command_env copies os.environ)
    t0 = time.perf_counter()
    run_logged(module_command("run", *run_flags(workdir, mode, os.path.join(root, "xla"))), None,
               os.path.join(root, f"{name}.log"))  # fmt: skip
    with open(os.path.join(workdir, "summary.json")) as f:
        s = json.load(f)
    tags = read_scalars(os.path.join(workdir, "tb"))
    last = lambda tag: tags[tag][-1][1] if tag in tags else None  # noqa: E731
    return {
        "mode": mode,
        "latency_ms": latency_ms,
        "steps": s["steps"],
        "rl_wall_s": s["wall_s"],
        "process_s": time.perf_counter() - t0,
        "train_tokens_per_s": s["train_tokens_per_s"],
        "steady_train_tokens_per_s": s["steady_train_tokens_per_s"],
        "steady_trainer_idle_frac": s["steady_trainer_idle_frac"],
        "staleness_mean": s["staleness_mean"],
        "tool_calls": last("env/tool_calls"),
        "episodes": last("env/episodes"),
        "parked_slot_fraction": last("env/parked_slot_fraction"),
        "turns_per_episode": last("env/turns_per_episode"),
        "warm_start": s["warm_start"],
    }


def main(_):
    root = FLAGS.keep or tempfile.mkdtemp(prefix="bench_tool_runs_")
    os.makedirs(root, exist_ok=True)
    rows = []
    for latency in map(float, FLAGS.latencies_ms):
        for mode in FLAGS.modes:
            rows.append(run_one(root, mode, latency))
            r = rows[-1]
            print(f"{mode:>5} {latency:>5g} ms: {r['train_tokens_per_s']:.0f} trained tok/s "
                  f"(steady {r['steady_train_tokens_per_s']:.0f}), {r['rl_wall_s']:.0f} s RL wall, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    load = os.getloadavg()
    print(f"\n{cpu_model()}, {os.cpu_count()} cores, load average {load}, {FLAGS.steps} steps per run")
    print("| latency per call | mode | steps | RL wall s | trained tok/s | steady trained tok/s | tool calls "
          "| episodes | parked-slot fraction |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        print(f"| {r['latency_ms']:g} ms | {r['mode']} | {r['steps']} | {r['rl_wall_s']:.0f} "
              f"| {r['train_tokens_per_s']:,.0f} | {r['steady_train_tokens_per_s']:,.0f} "
              f"| {fmt(r['tool_calls'], ',.0f')} | {fmt(r['episodes'], ',.0f')} "
              f"| {fmt(r['parked_slot_fraction'], '.2f')} |")  # fmt: skip
    by = {(r["mode"], r["latency_ms"]): r for r in rows}
    for latency in map(float, FLAGS.latencies_ms):
        if ("sync", latency) in by and ("async", latency) in by:
            a, s = by[("async", latency)], by[("sync", latency)]
            keys = ("train_tokens_per_s", "steady_train_tokens_per_s")
            total, steady = (a[k] / max(s[k], 1e-9) for k in keys)
            print(f"{latency:g} ms: async / sync trained tok/s = {total:.2f} (steady {steady:.2f})")
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
              "cores": os.cpu_count(), "load_average": load, "root": root, "runs": rows}  # fmt: skip
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
