"""Sync vs async RL throughput on one long-tailed workload (configs/bench_async.py), one process per run.

  python tools/bench_async.py --steps 30 --out /tmp/bench_async.json
  python tools/bench_async.py --steps 30 --processes 2 --pin-cores --predict --out /tmp/bench_mp.json

Every run is `launch/run.py` (or `launch/local_cluster.py`) in a process of its own; its summary.json is
read back. The runs:
  sync            one process: sample a batch to its last token, then train it (η = 0);
  async           one process: train steps and decode calls interleave (η = --eta);
  async_2proc     (--processes 2) the learner on process 0 and the sampler on process 1, each on its own
                  core with --pin-cores: the roles own their hardware, as on separate hosts.
With --predict, the roles are first timed alone (tools/bench_roles.py) on one core and on every core, and
the shared-host split model (jaxrl_async.perf.shared_host) predicts each run's throughput beside it.

Prints a JSON summary and a table: steady-state trained tokens/s (after the first fifth of the steps),
sampler and trainer idle fractions, head/token staleness, and each run over sync.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    "wall_s",
)


def config_flags(args, workdir: str, mode: str) -> list[str]:
    """launch/run.py flags for one run of the workload."""
    caps = f"lognormal:median={args.median},p99={args.p99},max={args.max_len},seed=1"
    values = {
        "workdir": workdir,
        "mode": mode,
        "max_staleness": args.eta,
        "total_steps": args.steps,
        "prompts_per_step": args.prompts,
        "samples_per_prompt": args.samples,
        "length_caps": caps,
        "model.n_layers": args.layers,
        "sampler.num_slots": args.slots,
        "sampler.max_new_tokens": args.max_len,
        "trainer.token_budget": max(256, args.max_len + 64),  # a row holds the longest sequence
    }
    return [f"--config={os.path.join(REPO, 'configs', 'bench_async.py')}"] + [
        f"--config.{k}={v}" for k, v in values.items()
    ]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))


def _run(cmd: list[str], cores: list[int] | None, log: str) -> None:
    pre = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    with open(log, "w") as f:
        res = subprocess.run(cmd, env=_env(), stdout=f, stderr=subprocess.STDOUT, preexec_fn=pre)
    if res.returncode != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({res.returncode}):\n{tail}")


def run_one(args, name: str, root: str) -> dict:
    workdir = os.path.join(root, name)
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run: nothing to resume from
    os.makedirs(workdir, exist_ok=True)
    log = os.path.join(root, f"{name}.log")
    py = sys.executable
    if name == "async_2proc":
        flags = config_flags(args, workdir, "async")
        flags += ["--config.mesh.trainer_processes=(0,)", "--config.mesh.sampler_processes=(1,)"]
        cmd = [py, os.path.join(REPO, "launch", "local_cluster.py"), "--num-processes", "2"]
        cmd += ["--pin-cores"] if args.pin_cores else []
        _run([*cmd, "--", *flags], None, log)
    else:
        _run([py, os.path.join(REPO, "launch", "run.py"), *config_flags(args, workdir, name)], None, log)
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def role_bench(args, root: str, cores: list[int] | None, name: str, decode_curve: bool = False) -> str:
    """tools/bench_roles.py on the workload, on `cores` (None: every core); returns the JSON path."""
    out = os.path.join(root, f"{name}.json")
    flags = config_flags(args, os.path.join(root, name), "async")
    cmd = [sys.executable, os.path.join(REPO, "tools", "bench_roles.py"), *flags, "--batches", "6"]
    cmd += ["--out", out] + (["--decode_curve"] if decode_curve else [])
    _run(cmd, cores, os.path.join(root, f"{name}.log"))
    return out


def predictions(args, root: str) -> dict[str, dict]:
    from jaxrl_async.perf.shared_host import load_role_bench, predict_async, predict_sync

    cores = sorted(os.sched_getaffinity(0))
    every = load_role_bench(role_bench(args, root, None, "roles_every_core"))
    out = {
        "sync": predict_sync(every, every).to_dict(),
        "async": predict_async(every, every, args.eta, cores=len(cores)).to_dict(),
    }
    if args.processes == 2:
        # Each role on a core of its own: the split model proper (rates, the staleness window), with
        # the engine's static decode batch.
        from jaxrl_async.perf import model as pm
        from jaxrl_async.perf.calibrated import calibrated_system, engine_lag_s, trained_tokens_per_s

        with open(role_bench(args, root, cores[:1], "roles_one_core", decode_curve=True)) as f:
            one = json.load(f)
        system = calibrated_system(
            one, prompts=args.prompts, samples=args.samples, median=args.median, p99=args.p99,
            max_len=args.max_len, eta=args.eta, static_batch=True, admit_lag_s=engine_lag_s(one),
        )  # fmt: skip
        r = pm.analyze_split(system, 1, 1)
        out["async_2proc"] = {**r.to_dict(), "tokens_per_s": trained_tokens_per_s(system, r.tokens_per_s)}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--median", type=float, default=24)
    p.add_argument("--p99", type=float, default=96)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--eta", type=int, default=4)
    p.add_argument("--layers", type=int, default=2, help="layer count (0 = the preset's)")
    p.add_argument("--processes", type=int, default=1, choices=(1, 2), help="2: also the two-process run")
    p.add_argument("--pin-cores", action="store_true", help="the two-process run's roles on separate cores")
    p.add_argument("--predict", action="store_true", help="time the roles alone and predict every run")
    p.add_argument("--runs", default="", help="comma-separated subset of sync,async,async_2proc")
    p.add_argument("--keep", default="", help="keep workdirs and logs here (default: a temporary directory)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    names = ["sync", "async"] + (["async_2proc"] if args.processes == 2 else [])
    if args.runs:
        names = [n for n in names if n in args.runs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or tmp
        os.makedirs(root, exist_ok=True)
        results = {n: run_one(args, n, root) for n in names}
        predicted = predictions(args, root) if args.predict else {}
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
    out = {"workload": vars(args), "cpus": cpus, "results": table, "predictions": predicted}
    print(json.dumps(out, indent=2))
    cols = ["steady_train_tokens_per_s", "over_sync", "predicted_tokens_per_s", "prediction_error"]
    cols += ["steady_sampler_idle_frac", "steady_trainer_idle_frac", "staleness_mean", "staleness_max"]
    cols += ["token_staleness_mean"]
    print("\n| run | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for n in names:
        cells = [f"{table[n][c]:.3g}" if c in table[n] else "" for c in cols]
        print(f"| {n} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
