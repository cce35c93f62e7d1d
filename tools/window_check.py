"""The staleness-window regime, checked against a real run: does the split model predict it?

  python tools/window_check.py --out /tmp/window_check.json

A workload whose throughput the η window bounds (η = 1, a long tail p99/median = 8, a fast trainer) runs
as two processes pinned to separate cores (learner on core 0, sampler on core 1). Before it, on one core:
the engine's decode step time with b busy slots of the run's engine, and with an engine of only b slots
(the t(b) the split model assumes when every busy slot costs, i.e. a paged engine); the trainer's step
time from tools/bench_roles.py. The split model (jaxrl_async.perf.model) and the simulator then predict
the run's trained tokens/s: charging t(busy slots) per decode step, t(all slots) (a static-shape
engine, `Sampler.static_batch`), t(all slots) with the engine's admission lag
(`jaxrl_async.perf.calibrated.engine_lag_s`), and that again with the trainer's step time as the run
measured it (its TensorBoard perf/train_step_s) instead of alone; beside what the run measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench_async import config_flags, role_bench  # one definition of the workload (a script beside this one)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KEYS = (
    "steady_train_tokens_per_s",
    "sampler_idle_frac",
    "trainer_idle_frac",
    "staleness_mean",
    "staleness_max",
)


def predict(args, roles: dict, static: bool, lag: bool = False, train_step_s: float | None = None) -> dict:
    """The split model and the simulator for the run; `lag`: with the engine's admission lag;
    `train_step_s`: the trainer's seconds per step instead of the role bench's."""
    from jaxrl_async.perf import model as pm
    from jaxrl_async.perf.calibrated import calibrated_system, engine_lag_s, trained_tokens_per_s
    from jaxrl_async.perf.simulator import simulate

    if train_step_s is not None:
        roles = dict(roles, train_step_s=train_step_s)
    system = calibrated_system(
        roles, prompts=args.prompts, samples=args.samples, median=args.median, p99=args.p99,
        max_len=args.max_len, eta=args.eta, static_batch=static,
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--median", type=float, default=12)
    p.add_argument("--p99", type=float, default=96)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--eta", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--keep", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or tmp
        os.makedirs(root, exist_ok=True)
        core = sorted(os.sched_getaffinity(0))[:1]
        roles = json.load(open(role_bench(args, root, core, "roles_one_core", decode_curve=True)))
        workdir = os.path.join(root, "run")
        flags = config_flags(args, workdir, "async")
        flags += ["--config.mesh.trainer_processes=(0,)", "--config.mesh.sampler_processes=(1,)"]
        cmd = [
            sys.executable,
            os.path.join(REPO, "launch", "local_cluster.py"),
            "--num-processes",
            "2",
            "--pin-cores",
        ]
        env = dict(os.environ, PYTHONPATH=REPO)
        with open(os.path.join(root, "run.log"), "w") as log:
            subprocess.run([*cmd, "--", *flags], env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        measured = json.load(open(os.path.join(workdir, "summary.json")))
        train_in_run = in_run_train_step_s(workdir)
    rows = {
        "predicted_busy_slots": ("t(busy slots)", predict(args, roles, static=False)),
        "predicted_all_slots": ("t(all slots)", predict(args, roles, static=True)),
        "predicted_all_slots_lag": ("t(all slots) + engine lag", predict(args, roles, True, lag=True)),
        "predicted_all_slots_lag_in_run_trainer": (
            "t(all slots) + engine lag, in-run train step",
            predict(args, roles, True, lag=True, train_step_s=train_in_run),
        ),
    }
    out = {
        "workload": vars(args),
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
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
