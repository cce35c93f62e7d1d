"""Sync vs async RL throughput on one long-tailed workload (benchmarks/configs/bench_async.py), each mode
at its own best number of decode slots, a process per run.

  python -m benchmarks.bench_async --steps 30 --out /tmp/bench_async.json
  python -m benchmarks.bench_async --processes 2 --pin-cores --predict --out /tmp/bench_mp.json

Every run is `jaxrl-run` (or `jaxrl-local-cluster`) in a process of its own; its summary.json is read
back. The modes:
  sync            one process: sample a batch to its last token, then train it (η = 0);
  async           one process: train steps and decode calls interleave (η = --max-staleness);
  async_2proc     (--processes 2) the learner on process 0 and the sampler on process 1, each on its own
                  core with --pin-cores: the roles own their hardware, as on separate hosts.
Best against best: each mode runs at every `--slot-sweep` value of sampler.num_slots (a slotted engine's
decode step costs the same at any occupancy and grows with the engine, so sync, which drains its batch,
wants few slots and async, which keeps them full, more), and the ratios compare each mode's best.
With --predict, the roles are first timed alone (benchmarks.bench_roles) on one core and on every core at
--slots; before the runs it prints the overlap ceiling there (jaxrl_async.perf.shared_host.overlap_ceiling:
tau, f, the roles' speeds). After the sweep the roles are timed again where each mode is at its best (sync
on every core at its best slots, the pinned roles on one core at async_2proc's), and the ceiling of that
best-against-best ratio and the fraction of it achieved are printed: the ceiling models the pinned
two-process layout, so the one-process async gets none. The shared-host split model's prediction of each
run at --slots sits beside it.

Prints a JSON summary and two tables: the sweep (steady-state trained tokens/s after the first fifth of
the steps, idle fractions, staleness, completion lengths) and each mode at its best over sync at its best.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

from absl import app, flags

from benchmarks import bench_workload as wl
from jaxrl_async.cli import module_command, run_command, run_logged
from jaxrl_async.perf.report import best_against_best

flags.adopt_module_key_flags(wl)
_PROCESSES = flags.DEFINE_integer("processes", 1, "2: also the two-process run.", 1, 2)
_PIN = flags.DEFINE_bool("pin-cores", False, "The two-process run's roles on separate cores.")
_PREDICT = flags.DEFINE_bool("predict", False, "Time the roles alone and predict every run.")
_RUNS = flags.DEFINE_string("runs", "", "Comma-separated subset of sync,async,async_2proc.")
_SWEEP = flags.DEFINE_list("slot-sweep", ["16", "64", "128", "256"],
                           "sampler.num_slots values every mode runs at (empty: --slots alone).")
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
    "completion_length_mean",
    "completion_length_p50",
    "completion_length_p99",
    "completion_length_max",
    "wall_s",
)


def run_one(w: wl.Workload, mode: str, root: str, pin_cores: bool) -> dict:
    name = f"{mode}_slots{w.slots}"
    workdir = os.path.join(root, name)
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run: nothing to resume from
    os.makedirs(workdir, exist_ok=True)
    log = os.path.join(root, f"{name}.log")
    if mode == "async_2proc":
        run_flags = wl.config_flags(w, workdir, "async")
        run_flags += ["--config.mesh.trainer_processes=(0,)", "--config.mesh.sampler_processes=(1,)"]
        run_logged([*wl.cluster_command(2, pin_cores), "--", *run_flags], None, log)
    else:
        run_logged(module_command("run", *wl.config_flags(w, workdir, mode)), None, log)
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def predictions(w: wl.Workload, root: str, processes: int) -> tuple[dict[str, dict], dict[str, float]]:
    """The split model's prediction of each mode at --slots, and the overlap ceiling there."""
    from jaxrl_async.perf.shared_host import load_role_bench, overlap_ceiling, predict_async, predict_sync

    cores = sorted(os.sched_getaffinity(0))
    every = load_role_bench(wl.role_bench(w, root, None, "roles_every_core"))
    one_path = wl.role_bench(w, root, cores[:1], "roles_one_core", decode_curve=True)
    ceiling = overlap_ceiling(every, load_role_bench(one_path))
    out = {
        "sync": predict_sync(every, every).to_dict(),
        "async": predict_async(every, every, w.max_staleness, cores=len(cores)).to_dict(),
    }
    if processes == 2:
        # Each role on a core of its own: the split model proper (rates, the staleness window), with
        # the engine's static decode batch.
        from jaxrl_async.perf import model as pm
        from jaxrl_async.perf.calibrated import calibrated_system, engine_lag_s, trained_tokens_per_s

        with open(one_path) as f:
            one = json.load(f)
        system = calibrated_system(
            one, prompts=w.prompts, samples=w.samples, median=w.median, p99=w.p99,
            max_len=w.max_len, max_staleness=w.max_staleness, static_batch=True,
                admit_lag_s=engine_lag_s(one),
        )  # fmt: skip
        r = pm.analyze_split(system, 1, 1)
        out["async_2proc"] = {**r.to_dict(), "tokens_per_s": trained_tokens_per_s(system, r.tokens_per_s)}
    return out, ceiling


def best_ceiling(w: wl.Workload, root: str, sync_slots: int, async_slots: int) -> dict[str, float]:
    """The overlap ceiling of the pinned two-process run at its best slot count over sync at its own: the
    roles timed again, sync's on every core at `sync_slots`, the pinned roles' on one core at
    `async_slots` (jaxrl_async.perf.shared_host.overlap_ceiling)."""
    from jaxrl_async.perf.shared_host import load_role_bench, overlap_ceiling

    one_core = sorted(os.sched_getaffinity(0))[:1]
    at = lambda n: dataclasses.replace(w, slots=n)  # noqa: E731
    # At --slots the benches `predictions` timed before the runs are reused, not timed again.
    every = os.path.join(root, "roles_every_core.json") if sync_slots == w.slots else wl.role_bench(
        at(sync_slots), root, None, f"roles_every_core_{sync_slots}")
    one = os.path.join(root, "roles_one_core.json") if async_slots == w.slots else wl.role_bench(
        at(async_slots), root, one_core, f"roles_one_core_{async_slots}")
    c = overlap_ceiling(load_role_bench(every), load_role_bench(one))
    return {**c, "sync_slots": sync_slots, "async_slots": async_slots}


def _cell(c) -> str:
    if c is None:
        return ""
    if isinstance(c, float):
        return f"{c:.0f}" if abs(c) >= 100 else f"{c:.3g}"
    return str(c)


def _row(cells: list) -> str:
    return "| " + " | ".join(map(_cell, cells)) + " |"


def main(argv):
    del argv
    w = wl.from_flags()
    processes = _PROCESSES.value
    modes = ["sync", "async"] + (["async_2proc"] if processes == 2 else [])
    if _RUNS.value:
        modes = [n for n in modes if n in _RUNS.value.split(",")]
    try:
        slot_values = sorted({int(s) for s in _SWEEP.value}) or [w.slots]
    except ValueError:
        raise app.UsageError(f"--slot-sweep: comma-separated integers, got {_SWEEP.value}") from None
    predicted, ceiling = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        root = _KEEP.value or tmp
        os.makedirs(root, exist_ok=True)
        if _PREDICT.value:
            predicted, ceiling = predictions(w, root, processes)
            print(f"overlap ceiling at {w.slots} slots (before the runs): " + ", ".join(
                f"{k} {v:.3g}" for k, v in ceiling.items()), flush=True)  # fmt: skip
        sweep = {m: {} for m in modes}
        for s in slot_values:
            for m in modes:
                summary = run_one(dataclasses.replace(w, slots=s), m, root, _PIN.value)
                sweep[m][s] = {k: summary.get(k) for k in KEYS}
                print(f"{m} at {s} slots: {sweep[m][s]['steady_train_tokens_per_s']:.1f} trained tokens/s",
                      flush=True)  # fmt: skip
        best = best_against_best(sweep)
        best_ceil = None
        # The ceiling models the pinned two-process layout (a role a core), so it bounds async_2proc only;
        # the roles are timed again at each one's best slot count, where the ratio is taken.
        if ceiling and "sync" in best and "async_2proc" in best:
            best_ceil = best_ceiling(w, root, best["sync"]["slots"], best["async_2proc"]["slots"])
            print(f"overlap ceiling best against best (sync at {best_ceil['sync_slots']} slots, the pinned "
                  f"roles at {best_ceil['async_slots']}): " + ", ".join(f"{k} {v:.3g}" for k, v in
                  best_ceil.items() if k not in ("sync_slots", "async_slots")), flush=True)  # fmt: skip
    for m, b in best.items():
        if m in predicted and b["slots"] == w.slots:
            b["predicted_tokens_per_s"] = predicted[m]["tokens_per_s"]
        if best_ceil and m == "async_2proc" and b["over_sync_best"]:
            b["ceiling"] = best_ceil["ceiling"]
            b["fraction_of_ceiling"] = b["over_sync_best"] / best_ceil["ceiling"]
    cpus = sorted(os.sched_getaffinity(0))
    workload = {**vars(w), "processes": processes, "pin_cores": _PIN.value, "predict": _PREDICT.value,
                "runs": _RUNS.value, "slot_sweep": slot_values, "keep": _KEEP.value,
                "out": _OUT.value}  # fmt: skip
    swept = {m: {str(s): r for s, r in runs.items()} for m, runs in sweep.items()}
    out = {"workload": workload, "cpus": cpus, "sweep": swept, "best": best, "ceiling": ceiling,
           "best_ceiling": best_ceil, "predictions": predicted}  # fmt: skip
    print(json.dumps(out, indent=2))
    cols = ["steady_train_tokens_per_s", "steady_sampler_idle_frac", "steady_trainer_idle_frac",
            "staleness_mean", "staleness_max", "completion_length_mean", "completion_length_p50",
            "completion_length_p99", "completion_length_max"]  # fmt: skip
    print("\nThe sweep:\n\n| mode | slots | " + " | ".join(cols) + " |\n|---|---|" + "---|" * len(cols))
    for m, runs in sweep.items():
        for s, r in runs.items():
            print(_row([m, s, *(r.get(c) for c in cols)]))
    cols = ["slots", "steady_train_tokens_per_s", "over_sync_best", "ceiling", "fraction_of_ceiling",
            "predicted_tokens_per_s"]  # fmt: skip
    print("\nBest against best:\n\n| mode | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for m, b in best.items():
        print(_row([m, *(b.get(c) for c in cols)]))
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(out, f, indent=2)


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m benchmarks.bench_async`
    run()
