"""Where the roles own their hardware: a local cluster of single-core processes over every
sampler/trainer split, measured, beside the split model's prediction and its chosen split.

  python -m benchmarks.split_sweep --processes 8 --out /tmp/split_sweep.json   # a 16-core host
  python -m benchmarks.split_sweep --processes 3 --splits 1+2,2+1 --steps 8    # a quick look on 4 cores

Each split s+t runs `jaxrl-local-cluster --num-processes s+t --pin-cores` on the workload of
python -m benchmarks.bench_async (benchmarks/bench_workload.py; here 64 prompts and 128 slots by default):
processes 0..t-1 train (one FSDP trainer mesh of t devices), processes t..s+t-1 sample (one replica
each), every process on its own block of cores. Before the sweep the roles are timed alone on one core
(benchmarks.bench_roles --decode_curve); the split model (`perf.model.analyze_split` with `perf.calibrated`)
then predicts each split: s replicas of the measured engine (a static decode batch), t trainer devices at
t times one device's measured rate (FSDP scaling assumed linear), and the staleness window.
"""

from __future__ import annotations

import json
import os
import tempfile

from absl import app, flags

from benchmarks import bench_workload as wl
from jaxrl_async.cli import run_command, run_logged

wl.set_defaults(prompts=64, slots=128)
flags.adopt_module_key_flags(wl)
_PROCESSES = flags.DEFINE_integer("processes", 8, "Single-core processes of each split.", lower_bound=2)
_SPLITS = flags.DEFINE_string("splits", "", "sampler+trainer pairs, e.g. 2+6,4+4 (default: 2+6 ... 6+2)")
_ROWS = flags.DEFINE_integer("rows", 8, "Micro-batch rows per trainer device.", lower_bound=1)
_KEEP = flags.DEFINE_string("keep", "", "Keep workdirs and logs here (default: a temporary directory).")
_OUT = flags.DEFINE_string("out", "", "Also write the JSON summary here.")


def predict(w: wl.Workload, roles: dict, s: int, t: int) -> dict:
    """The split model for s sampler replicas and t trainer devices, from one-core role measurements."""
    from jaxrl_async.perf import model as pm
    from jaxrl_async.perf.calibrated import calibrated_system, engine_lag_s, trained_tokens_per_s

    system = calibrated_system(
        roles, prompts=w.prompts, samples=w.samples, median=w.median, p99=w.p99,
        max_len=w.max_len, max_staleness=w.max_staleness, static_batch=True, sampler_devices=s,
            trainer_devices=t,
        admit_lag_s=engine_lag_s(roles),
    )  # fmt: skip
    r = pm.analyze_split(system, s, t)
    return {**r.to_dict(), "tokens_per_s": trained_tokens_per_s(system, r.tokens_per_s)}


def run_split(w: wl.Workload, rows: int, s: int, t: int, root: str) -> dict:
    workdir = os.path.join(root, f"split_{s}+{t}")
    run_flags = wl.config_flags(w, workdir, "async")
    run_flags += [
        f"--config.mesh.trainer=({t},1)",
        "--config.mesh.sampler=(1,1)",
        f"--config.mesh.trainer_processes={tuple(range(t))}",
        f"--config.mesh.sampler_processes={tuple(range(t, s + t))}",
        f"--config.trainer.rows_per_micro={rows * t}",
    ]
    cmd = [*wl.cluster_command(s + t, pin_cores=True), "--", *run_flags]
    run_logged(cmd, None, os.path.join(root, f"split_{s}+{t}.log"))
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def splits(spec: str, n: int) -> list[tuple[int, int]]:
    """(sampler, trainer) process counts from --splits, or every split of n with two or more of each.

    Raises:
      app.UsageError: a malformed pair.
    """
    if not spec:
        if n < 4:
            raise app.UsageError(f"--processes {n}: no split has two of each; name them with --splits")
        return [(s, n - s) for s in range(2, n - 1)]
    pairs = []
    for pair in spec.split(","):
        s, plus, t = pair.partition("+")
        if not (plus and s.isdigit() and t.isdigit() and int(s) > 0 and int(t) > 0):
            raise app.UsageError(f"--splits: {pair!r} is not SAMPLERS+TRAINERS (e.g. 2+6)")
        pairs.append((int(s), int(t)))
    return pairs


def main(argv) -> None:
    del argv
    w = wl.from_flags()
    pairs = splits(_SPLITS.value, _PROCESSES.value)
    with tempfile.TemporaryDirectory() as tmp:
        root = _KEEP.value or tmp
        os.makedirs(root, exist_ok=True)
        core = sorted(os.sched_getaffinity(0))[:1]
        with open(wl.role_bench(w, root, core, "roles_one_core", decode_curve=True)) as f:
            roles = json.load(f)
        rows = []
        for s, t in pairs:
            measured = run_split(w, _ROWS.value, s, t, root)
            pred = predict(w, roles, s, t)
            rows.append(
                {
                    "sampler_processes": s,
                    "trainer_processes": t,
                    "measured_tokens_per_s": measured["steady_train_tokens_per_s"],
                    "predicted_tokens_per_s": pred["tokens_per_s"],
                    "predicted_bottleneck": pred["bottleneck"],
                    "sampler_idle_frac": measured["steady_sampler_idle_frac"],
                    "trainer_idle_frac": measured["steady_trainer_idle_frac"],
                }
            )
    best_m = max(rows, key=lambda r: r["measured_tokens_per_s"])
    best_p = max(rows, key=lambda r: r["predicted_tokens_per_s"])
    workload = {**vars(w), "processes": _PROCESSES.value, "splits": _SPLITS.value, "rows": _ROWS.value,
                "keep": _KEEP.value, "out": _OUT.value}  # fmt: skip
    out = {"workload": workload, "splits": rows, "best_measured": best_m, "best_predicted": best_p}
    print(json.dumps(out, indent=2))
    cols = ["split s+t", "measured tok/s", "predicted", "error", "predicted bottleneck", "sampler idle"]
    print("\n| " + " | ".join([*cols, "trainer idle"]) + " |\n|" + "---|" * (len(cols) + 1))
    for r in rows:
        err = r["predicted_tokens_per_s"] / r["measured_tokens_per_s"] - 1
        print(f"| {r['sampler_processes']}+{r['trainer_processes']} | {r['measured_tokens_per_s']:.0f} | "
              f"{r['predicted_tokens_per_s']:.0f} | {err:+.1%} | {r['predicted_bottleneck']} | "
              f"{r['sampler_idle_frac']:.2f} | {r['trainer_idle_frac']:.2f} |")  # fmt: skip
    print(f"best split: measured {best_m['sampler_processes']}+{best_m['trainer_processes']}, "
          f"predicted {best_p['sampler_processes']}+{best_p['trainer_processes']}")  # fmt: skip
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(out, f, indent=2)


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m benchmarks.split_sweep`
    run()
