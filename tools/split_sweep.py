"""Where the roles own their hardware: a local cluster of single-core processes over every
sampler/trainer split, measured, beside the split model's prediction and its chosen split.

  python tools/split_sweep.py --processes 8 --out /tmp/split_sweep.json          # a 16-core host
  python tools/split_sweep.py --processes 3 --splits 1+2,2+1 --steps 8           # a quick look on 4 cores

Each split s+t runs `launch/local_cluster.py --num-processes s+t --pin-cores` on the workload of
tools/bench_async.py: processes 0..t-1 train (one FSDP trainer mesh of t devices), processes t..s+t-1
sample (one replica each), every process on its own block of cores. Before the sweep the roles are timed
alone on one core (tools/bench_roles.py --decode_curve); the split model (`perf.model.analyze_split`
with `perf.calibrated`) then predicts each split: s replicas of the measured engine (a static decode
batch), t trainer devices at t times one device's measured rate (FSDP scaling assumed linear), and the
staleness window.
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


def predict(args, roles: dict, s: int, t: int) -> dict:
    """The split model for s sampler replicas and t trainer devices, from one-core role measurements."""
    from jaxrl_async.perf import model as pm
    from jaxrl_async.perf.calibrated import calibrated_system, engine_lag_s, trained_tokens_per_s

    system = calibrated_system(
        roles, prompts=args.prompts, samples=args.samples, median=args.median, p99=args.p99,
        max_len=args.max_len, eta=args.eta, static_batch=True, sampler_devices=s, trainer_devices=t,
        admit_lag_s=engine_lag_s(roles),
    )  # fmt: skip
    r = pm.analyze_split(system, s, t)
    return {**r.to_dict(), "tokens_per_s": trained_tokens_per_s(system, r.tokens_per_s)}


def run_split(args, s: int, t: int, root: str) -> dict:
    workdir = os.path.join(root, f"split_{s}+{t}")
    flags = config_flags(args, workdir, "async")
    flags += [
        f"--config.mesh.trainer=({t},1)",
        "--config.mesh.sampler=(1,1)",
        f"--config.mesh.trainer_processes={tuple(range(t))}",
        f"--config.mesh.sampler_processes={tuple(range(t, s + t))}",
        f"--config.trainer.rows_per_micro={args.rows * t}",
    ]
    cmd = [sys.executable, os.path.join(REPO, "launch", "local_cluster.py"), "--num-processes", str(s + t)]
    cmd.append("--pin-cores")
    env = dict(os.environ, PYTHONPATH=REPO)
    with open(os.path.join(root, f"split_{s}+{t}.log"), "w") as log:
        subprocess.run([*cmd, "--", *flags], env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=8)
    p.add_argument("--splits", default="", help="sampler+trainer pairs, e.g. 2+6,4+4 (default: 2+6 ... 6+2)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--median", type=float, default=24)
    p.add_argument("--p99", type=float, default=96)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--eta", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=8, help="micro-batch rows per trainer device")
    p.add_argument("--keep", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()
    n = args.processes
    pairs = [tuple(int(x) for x in pair.split("+")) for pair in args.splits.split(",")] if args.splits else [
        (s, n - s) for s in range(2, n - 1)
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or tmp
        os.makedirs(root, exist_ok=True)
        core = sorted(os.sched_getaffinity(0))[:1]
        with open(role_bench(args, root, core, "roles_one_core", decode_curve=True)) as f:
            roles = json.load(f)
        rows = []
        for s, t in pairs:
            measured = run_split(args, s, t, root)
            pred = predict(args, roles, s, t)
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
    out = {"workload": vars(args), "splits": rows, "best_measured": best_m, "best_predicted": best_p}
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
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
