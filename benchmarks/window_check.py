"""The staleness-window regime, checked against a real run: does the split model predict it?

  python -m benchmarks.window_check --out /tmp/window_check.json

A workload whose throughput the η window bounds (η = 1, a long tail p99/median = 8, a fast trainer) runs
as two processes pinned to separate cores (learner on core 0, sampler on core 1). Before it, on one core:
the engine's decode step time with b busy slots of the run's engine, and with an engine of only b slots
(the t(b) the split model assumes when every busy slot costs, i.e. a paged engine); the trainer's step
time from benchmarks.bench_roles. The split model (jaxrl_async.perf.model) and the simulator then predict
the run's trained tokens/s: charging t(busy slots) per decode step, t(all slots) (a static-shape
engine, `Sampler.static_batch`), t(all slots) with the engine's admission lag
(`jaxrl_async.perf.calibrated.engine_lag_s`), and that again with the trainer's step time as the run
measured it (its TensorBoard perf/train_step_s) instead of alone; beside what the run measured.
"""

from __future__ import annotations

import json
import os
import tempfile

from absl import flags

from benchmarks import bench_workload as wl
from jaxrl_async.cli import run_command, run_logged

wl.set_defaults(steps=40, prompts=8, median=12, max_staleness=1)
flags.adopt_module_key_flags(wl)
_KEEP = flags.DEFINE_string("keep", "", "Keep workdirs and logs here (default: a temporary directory).")
_OUT = flags.DEFINE_string("out", "", "Also write the JSON summary here.")

KEYS = (
    "steady_train_tokens_per_s",
    "sampler_idle_frac",
    "trainer_idle_frac",
    "staleness_mean",
    "staleness_max",
)


def predict(
    w: wl.Workload, roles: dict, static: bool, lag: bool = False, train_step_s: float | None = None
) -> dict:
    """The split model and the simulator for the run; `lag`: with the engine's admission lag;
    `train_step_s`: the trainer's seconds per step instead of the role bench's."""
    from jaxrl_async.perf import model as pm
    from jaxrl_async.perf.calibrated import calibrated_system, engine_lag_s, trained_tokens_per_s
    from jaxrl_async.perf.simulator import simulate

    if train_step_s is not None:
        roles = dict(roles, train_step_s=train_step_s)
    system = calibrated_system(
        roles, prompts=w.prompts, samples=w.samples, median=w.median, p99=w.p99,
        max_len=w.max_len, max_staleness=w.max_staleness, static_batch=static,
        admit_lag_s=engine_lag_s(roles) if lag else 0.0,
    )  # fmt: skip
    a = pm.analyze_split(system, 1, 1)
    sim = simulate(system, 1, 1, steps=200, warmup=20, seed=0)
    return {
        "model_tokens_per_s": trained_tokens_per_s(system, a.tokens_per_s),
        "simulated_tokens_per_s": trained_tokens_per_s(system, sim.tokens_per_s),
        "bottleneck": a.bottleneck,
        "decode_batch": a.decode_batch,
        "mean_staleness": a.mean_staleness,
        "train_rate": a.train_rate,
        "sample_rate": a.sample_rate,
        "window_rate": a.window_rate,
        "admit_lag_s": system.sampler.admit_lag_s,
        "train_step_s": roles["train_step_s"],
    }


def in_run_train_step_s(workdir: str) -> float:
    """Mean of the run's perf/train_step_s after the first fifth of the steps (its TensorBoard files)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(os.path.join(workdir, "tb"), size_guidance={"scalars": 0})
    ea.Reload()
    values = [e.value for e in ea.Scalars("perf/train_step_s")]
    steady = values[max(2, len(values) // 5) :]
    return sum(steady) / len(steady)


def main(argv):
    del argv
    w = wl.from_flags()
    with tempfile.TemporaryDirectory() as tmp:
        root = _KEEP.value or tmp
        os.makedirs(root, exist_ok=True)
        core = sorted(os.sched_getaffinity(0))[:1]
        with open(wl.role_bench(w, root, core, "roles_one_core", decode_curve=True)) as f:
            roles = json.load(f)
        workdir = os.path.join(root, "run")
        run_flags = wl.config_flags(w, workdir, "async")
        run_flags += ["--config.mesh.trainer_processes=(0,)", "--config.mesh.sampler_processes=(1,)"]
        cmd = [*wl.cluster_command(2, pin_cores=True), "--", *run_flags]
        run_logged(cmd, None, os.path.join(root, "run.log"))
        with open(os.path.join(workdir, "summary.json")) as f:
            measured = json.load(f)
        train_in_run = in_run_train_step_s(workdir)
    rows = {
        "predicted_busy_slots": ("t(busy slots)", predict(w, roles, static=False)),
        "predicted_all_slots": ("t(all slots)", predict(w, roles, static=True)),
        "predicted_all_slots_lag": ("t(all slots) + engine lag", predict(w, roles, True, lag=True)),
        "predicted_all_slots_lag_in_run_trainer": (
            "t(all slots) + engine lag, in-run train step",
            predict(w, roles, True, lag=True, train_step_s=train_in_run),
        ),
    }
    out = {
        "workload": {**vars(w), "keep": _KEEP.value, "out": _OUT.value},
        "roles": roles,
        "measured": {**{k: measured[k] for k in KEYS}, "train_step_s": train_in_run},
        **{k: r for k, (_, r) in rows.items()},
    }
    print(json.dumps(out, indent=2))
    m = out["measured"]["steady_train_tokens_per_s"]
    print("\n| decode step cost | train step s | model tok/s | simulator tok/s | measured | model error |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.values():
        model, sim = r["model_tokens_per_s"], r["simulated_tokens_per_s"]
        err = model / m - 1
        print(f"| {name} | {r['train_step_s']:.3f} | {model:.0f} | {sim:.0f} | {m:.0f} | {err:+.1%} |")
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(out, f, indent=2)


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m benchmarks.window_check`
    run()
