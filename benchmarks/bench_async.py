"""Sync vs async RL throughput on one long-tailed workload (benchmarks/configs/bench_async.py), a process
per run.

  python -m benchmarks.bench_async --steps 30 --out /tmp/bench_async.json
  python -m benchmarks.bench_async --steps 30 --processes 2 --pin-cores --predict --out /tmp/bench_mp.json

Every run is `jaxrl-run` (or `jaxrl-local-cluster`) in a process
of its own; its summary.json is read back. The runs:
  sync            one process: sample a batch to its last token, then train it (η = 0);
  async           one process: train steps and decode calls interleave (η = --max-staleness);
  async_2proc     (--processes 2) the learner on process 0 and the sampler on process 1, each on its own
                  core with --pin-cores: the roles own their hardware, as on separate hosts.
With --predict, the roles are first timed alone (benchmarks.bench_roles) on one core and on every core, and
the shared-host split model (jaxrl_async.perf.shared_host) predicts each run's throughput beside it.

Prints a JSON summary and a table: steady-state trained tokens/s (after the first fifth of the steps),
sampler and trainer idle fractions, head/token staleness, and each run over sync.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from absl import flags

from benchmarks import bench_workload as wl
from jaxrl_async.cli import module_command, run_command, run_logged

flags.adopt_module_key_flags(wl)
_PROCESSES = flags.DEFINE_integer("processes", 1, "2: also the two-process run.", 1, 2)
_PIN = flags.DEFINE_bool("pin-cores", False, "The two-process run's roles on separate cores.")
_PREDICT = flags.DEFINE_bool("predict", False, "Time the roles alone and predict every run.")
_RUNS = flags.DEFINE_string("runs", "", "Comma-separated subset of sync,async,async_2proc.")
_KEEP = flags.DEFINE_string("keep", "", "Keep workdirs and logs here (default: a temporary directory).")
_OUT = flags.DEFINE_string("out", "", "Also write the JSON summary here.")

KEYS = (
    "steady_train_tokens_per_s",
    "train_tokens_per_s",
    "sample_tokens_per_s",
    "steady_sampler_idle_frac",
    "steady_trainer_idle_frac",
    "staleness_mean",
    "staleness_max",
    "token_staleness_mean",
    "weight_sync_s_mean",
    "weight_sync_frac",
    "wall_s",
)


def run_one(w: wl.Workload, name: str, root: str, pin_cores: bool) -> dict:
    workdir = os.path.join(root, name)
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run: nothing to resume from
    os.makedirs(workdir, exist_ok=True)
    log = os.path.join(root, f"{name}.log")
    if name == "async_2proc":
        run_flags = wl.config_flags(w, workdir, "async")
        run_flags += ["--config.mesh.trainer_processes=(0,)", "--config.mesh.sampler_processes=(1,)"]
        run_logged([*wl.cluster_command(2, pin_cores), "--", *run_flags], None, log)
    else:
        run_logged(module_command("run", *wl.config_flags(w, workdir, name)), None, log)
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def predictions(w: wl.Workload, root: str, processes: int) -> dict[str, dict]:
    from jaxrl_async.perf.shared_host import load_role_bench, predict_async, predict_sync

    cores = sorted(os.sched_getaffinity(0))
    every = load_role_bench(wl.role_bench(w, root, None, "roles_every_core"))
    out = {
        "sync": predict_sync(every, every).to_dict(),
        "async": predict_async(every, every, w.max_staleness, cores=len(cores)).to_dict(),
    }
    if processes == 2:
        # Each role on a core of its own: the split model proper (rates, the staleness window), with
        # the engine's static decode batch.
        from jaxrl_async.perf import model as pm
        from jaxrl_async.perf.calibrated import calibrated_system, engine_lag_s, trained_tokens_per_s

        with open(wl.role_bench(w, root, cores[:1], "roles_one_core", decode_curve=True)) as f:
            one = json.load(f)
        system = calibrated_system(
            one, prompts=w.prompts, samples=w.samples, median=w.median, p99=w.p99,
            max_len=w.max_len, max_staleness=w.max_staleness, static_batch=True,
                admit_lag_s=engine_lag_s(one),
        )  # fmt: skip
        r = pm.analyze_split(system, 1, 1)
        out["async_2proc"] = {**r.to_dict(), "tokens_per_s": trained_tokens_per_s(system, r.tokens_per_s)}
    return out


def main(argv):
    del argv
    w = wl.from_flags()
    processes = _PROCESSES.value
    names = ["sync", "async"] + (["async_2proc"] if processes == 2 else [])
    if _RUNS.value:
        names = [n for n in names if n in _RUNS.value.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = _KEEP.value or tmp
        os.makedirs(root, exist_ok=True)
        results = {n: run_one(w, n, root, _PIN.value) for n in names}
        predicted = predictions(w, root, processes) if _PREDICT.value else {}
    table = {n: {k: results[n][k] for k in KEYS} for n in names}
    base = table.get("sync", {}).get("steady_train_tokens_per_s")
    for n in names:
        if base:
            table[n]["over_sync"] = table[n]["steady_train_tokens_per_s"] / base
        if n in predicted:
            pred = predicted[n]["tokens_per_s"]
            table[n]["predicted_tokens_per_s"] = pred
            table[n]["prediction_error"] = pred / table[n]["steady_train_tokens_per_s"] - 1
    cpus = sorted(os.sched_getaffinity(0))
    workload = {**vars(w), "processes": processes, "pin_cores": _PIN.value, "predict": _PREDICT.value,
                "runs": _RUNS.value, "keep": _KEEP.value, "out": _OUT.value}  # fmt: skip
    out = {"workload": workload, "cpus": cpus, "results": table, "predictions": predicted}
    print(json.dumps(out, indent=2))
    cols = ["steady_train_tokens_per_s", "over_sync", "predicted_tokens_per_s", "prediction_error"]
    cols += ["steady_sampler_idle_frac", "steady_trainer_idle_frac", "staleness_mean", "staleness_max"]
    cols += ["token_staleness_mean"]
    print("\n| run | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for n in names:
        cells = [f"{table[n][c]:.3g}" if c in table[n] else "" for c in cols]
        print(f"| {n} | " + " | ".join(cells) + " |")
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(out, f, indent=2)


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m benchmarks.bench_async`
    run()
