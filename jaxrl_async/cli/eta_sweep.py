"""The staleness study: held-out accuracy against the staleness bound eta, one line per objective.

  jaxrl-eta-sweep --out runs/eta_sweep --etas 0,1,2,4,8,16 --losses decoupled_ppo,ppo,reinforce_tis \
      --seeds 0,1 --steps 200 --processes-per-cell 2 --pin-cores --cores-per-cell 2

(or `python tools/eta_sweep.py ...`). Every cell is `jaxrl-run --config=configs/eta_sweep.py`
(AReaL's setting: four minibatch updates per batch) with eta (mode=sync at eta 0), the loss and the seed
overridden. With --processes-per-cell 2 a cell's learner and sampler run in processes of their own
(jaxrl-local-cluster), each on a core of its own with --pin-cores --cores-per-cell 2: only then does
the sampler outpace the trainer so that admission runs the full eta ahead. Cells run --parallel at a
time. The warm start of each seed is computed once first (cached), so the cells of a seed start from the
same policy.

At eta = 0 the behaviour policy is the proximal one, so `ppo` and `decoupled_ppo` are the same objective:
only `decoupled_ppo` runs there, and its cells stand for both lines.

--dynamic-etas adds cells with DAPO dynamic sampling (trainer.dynamic_sampling) for the first loss, to
compare with the config's zero-advantage skipping at the same eta. --deadline-s stops the cells still
running at that time with SIGTERM: they save and stop, and the report compares every cell at the last
evaluation step that all of them reached.

Writes OUT/eta_sweep.json (every cell and the per-setting means) and OUT/eta_sweep.png (accuracy vs eta),
and prints a markdown table. --report-only rereads OUT's cells and writes the report again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
from absl import flags

from jaxrl_async.cli import module_command, run_command

# The checkout: configs/ is not part of the installed package.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_OUT = flags.DEFINE_string("out", "runs/eta_sweep", "Directory for the cells' workdirs and the report.")
_CONFIG = flags.DEFINE_string("config", os.path.join(REPO, "configs", "eta_sweep.py"), "The cell config.")
_ETAS = flags.DEFINE_list("etas", ["0", "1", "2", "4", "8", "16"], "Staleness bounds (0 = sync).")
_LOSSES = flags.DEFINE_list("losses", ["decoupled_ppo", "ppo", "reinforce_tis"], "Objectives (trainer.loss).")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1"], "Seeds (init, warm start, data order, sampling).")
_STEPS = flags.DEFINE_integer("steps", 150, "Train steps per cell.")
_DYNAMIC = flags.DEFINE_list("dynamic-etas", [], "Etas at which to add dynamic-sampling cells.")
_PARALLEL = flags.DEFINE_integer("parallel", 0, "Cells at a time; 0 = one per available CPU.")
_PIN = flags.DEFINE_bool("pin-cores", False, "Pin each running cell to cores of its own.")
_PROCESSES = flags.DEFINE_integer(
    "processes-per-cell", 1, "2: each cell runs the learner and the sampler in processes of their own "
    "(jaxrl-local-cluster --pin-cores: a core each with --cores-per-cell 2), as on separate hosts.")
_CORES = flags.DEFINE_integer("cores-per-cell", 1, "With --pin-cores: cores per cell (the sampler and the "
                              "trainer overlap only on cores of their own).")  # fmt: skip
_DEADLINE = flags.DEFINE_float("deadline-s", 0.0, "SIGTERM the cells still running after this; 0 = off.")
_SET = flags.DEFINE_multi_string("set", [], "KEY=VALUE config override for every cell (repeatable).")
_REPORT_ONLY = flags.DEFINE_bool("report-only", False, "Only reread OUT's cells and write the report.")
_PREWARM = flags.DEFINE_bool("prewarm", True, "Run each seed's warm start first (skip when it is cached).")

# Per-step TensorBoard scalars averaged over a cell's steps (the objective's own diagnostics).
TB_MEANS = (
    "train/clip_low_frac",
    "train/clip_high_frac",
    "train/behav_dropped_frac",
    "is_weight/mean",
    "train/kl_behav",
    "train/uninformative_group_frac",
    "dynamic_sampling/yield",
)


def cells(etas, losses, seeds, dynamic_etas) -> list[dict]:
    """The grid: every (eta, loss, seed), without ppo at eta 0, plus the dynamic-sampling cells."""
    out = []
    for eta in etas:
        for loss in losses:
            if eta == 0 and loss == "ppo" and "decoupled_ppo" in losses:
                continue
            out += [dict(eta=eta, loss=loss, seed=s, dynamic=False) for s in seeds]
    out += [dict(eta=eta, loss=losses[0], seed=s, dynamic=True) for eta in dynamic_etas for s in seeds]
    for c in out:
        c["name"] = f"eta{c['eta']}_{c['loss']}_s{c['seed']}" + ("_dyn" if c["dynamic"] else "")
    return out


def cell_command(cell: dict, workdir: str, steps: int, overrides: list[str]) -> list[str]:
    values = {"workdir": workdir, "seed": cell["seed"], "total_steps": steps, "trainer.loss": cell["loss"]}
    if cell["eta"] == 0:
        values["mode"] = "sync"
    else:
        values["max_staleness"] = cell["eta"]
    if cell["dynamic"]:
        values["trainer.dynamic_sampling"] = True
        values["trainer.skip_zero_advantage"] = False  # every trained group is informative anyway
    run_flags = [f"--config={_CONFIG.value}", *(f"--config.{k}={v}" for k, v in values.items())]
    run_flags += [f"--config.{kv}" for kv in overrides]
    if _PROCESSES.value == 1:
        return module_command("run", *run_flags)
    run_flags += ["--config.mesh.trainer_processes=(0,)", "--config.mesh.sampler_processes=(1,)"]
    return module_command("local_cluster", "--num-processes", "2", "--pin-cores", "--", *run_flags)


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))


def core_block(cpus: list[int], k: int, i: int) -> tuple[int, ...]:
    """The `k` cores of the i-th cell started: consecutive blocks, shifted by one core each time the cores
    run out. jaxrl-local-cluster gives a block's lowest core to the learner, so the shift spreads the
    learners (busy) and the samplers (mostly idle) over every core when cells outnumber blocks."""
    n = len(cpus)
    if k >= n:
        return tuple(cpus)
    rnd, j = divmod(i, n // k)
    start = j * k + rnd
    return tuple(sorted(cpus[(start + m) % n] for m in range(k)))


def run_cells(todo: list[tuple[list[str], str]], parallel: int, pin: bool, deadline_s: float,
              cores_per_cell: int = 1) -> None:  # fmt: skip
    """Runs (command, log path) pairs `parallel` at a time; with `pin`, each on a block of
    `cores_per_cell` cores (see core_block)."""
    cpus = sorted(os.sched_getaffinity(0))
    started = 0
    running: dict[subprocess.Popen, tuple[int | None, object]] = {}
    t0, stopping = time.monotonic(), False
    queue = list(todo)
    while queue or running:
        while queue and len(running) < parallel and not stopping:
            cmd, log = queue.pop(0)
            core = core_block(cpus, cores_per_cell, started) if pin else None
            started += 1
            pre = (lambda c=core: os.sched_setaffinity(0, c)) if core is not None else None
            f = open(log, "w")  # noqa: SIM115 - closed when the cell ends
            p = subprocess.Popen(cmd, env=_env(), stdout=f, stderr=subprocess.STDOUT, preexec_fn=pre)
            running[p] = (core, f)
            print(f"[{time.monotonic() - t0:6.0f}s] start {os.path.basename(log)} core={core}", flush=True)
            time.sleep(0.2)  # staggered: each cell picks free localhost ports for its processes
        for p in [p for p in running if p.poll() is not None]:
            core, f = running.pop(p)
            f.close()
            name = os.path.basename(f.name)
            print(f"[{time.monotonic() - t0:6.0f}s] done  {name} rc={p.returncode}", flush=True)
        if deadline_s and not stopping and time.monotonic() - t0 > deadline_s:
            stopping = True  # the cells save and stop after their step in flight
            print(f"deadline: stopping {len(running)} cells, {len(queue)} never started", flush=True)
            for p in running:
                p.send_signal(signal.SIGTERM)
            queue.clear()
        time.sleep(0.5)


def _tb_means(workdir: str) -> dict[str, float]:
    from jaxrl_async.runtime.metrics import read_scalars

    try:
        scalars = read_scalars(os.path.join(workdir, "tb"))
    except Exception:  # noqa: BLE001 - a cell without events reports none
        return {}
    out = {k: float(np.mean([v for _, v in scalars[k]])) for k in TB_MEANS if scalars.get(k)}
    if scalars.get("is_weight/max"):
        out["is_weight/max"] = float(max(v for _, v in scalars["is_weight/max"]))
    return out


def _from_events(cell: dict, workdir: str) -> dict:
    """What a cell's TensorBoard events hold when it wrote no summary (it failed, e.g. while stopping):
    its evaluations and staleness, flagged `no_summary`; an error if there are no evaluations either."""
    from jaxrl_async.runtime.metrics import read_scalars

    try:
        scalars = read_scalars(os.path.join(workdir, "tb"))
    except Exception:  # noqa: BLE001 - no events at all
        scalars = {}
    if not scalars.get("eval/accuracy"):
        return {**cell, "error": f"no summary.json and no evaluations in {workdir} (see {workdir}.log)"}
    evals = {int(s): float(a) for s, a in scalars["eval/accuracy"]}
    head = [v for _, v in scalars.get("staleness/mean", [])]
    return {
        **cell,
        "no_summary": True,
        "steps": max(s for s, _ in scalars["loss/policy"]),
        "evals": evals,
        "initial_accuracy": evals.get(0),
        "final_accuracy": evals[max(evals)],
        "best_accuracy": max((a for st, a in evals.items() if st > 0), default=None),
        "head_staleness_mean": float(np.mean(head)) if head else None,
        "head_staleness_max": max((v for _, v in scalars.get("staleness/max", [])), default=None),
        "token_staleness_mean": _mean([v for _, v in scalars.get("staleness/token_mean", [])]),
        **_tb_means(workdir),
    }


def read_cell(cell: dict, workdir: str) -> dict:
    """A cell's results from its summary.json and TensorBoard events (see _from_events without one)."""
    path = os.path.join(workdir, "summary.json")
    if not os.path.exists(path):
        return _from_events(cell, workdir)
    with open(path) as f:
        s = json.load(f)
    evals = {int(e["step"]): float(e["accuracy"]) for e in s.get("evals", [])}
    return {
        **cell,
        "steps": s["steps"],
        "evals": evals,
        "initial_accuracy": evals.get(0),
        "final_accuracy": s.get("final_accuracy"),
        "best_accuracy": max((a for st, a in evals.items() if st > 0), default=None),
        "wall_s": s.get("wall_s"),
        "train_tokens_per_s": s.get("steady_train_tokens_per_s") or s.get("train_tokens_per_s"),
        "head_staleness_mean": s.get("staleness_mean"),
        "head_staleness_max": s.get("staleness_max"),
        "token_staleness_mean": s.get("token_staleness_mean"),
        "filtered_groups": s.get("filtered_groups", 0),
        **_tb_means(workdir),
    }


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def aggregate(results: list[dict]) -> tuple[int | None, list[dict]]:
    """Per (eta, loss, dynamic) means over seeds, accuracy taken at the last evaluation step every cell
    reached (the common step), so cells stopped early by a deadline compare fairly."""
    ok = [r for r in results if "error" not in r]
    common = min((max(r["evals"]) for r in ok if r["evals"]), default=None)
    rows = {}
    for r in ok:
        key = (r["eta"], r["loss"], r["dynamic"])
        r["accuracy_at_common"] = r["evals"].get(common) if common is not None else None
        rows.setdefault(key, []).append(r)
    out = []
    for (eta, loss, dyn), rs in sorted(rows.items()):
        row = {"eta": eta, "loss": loss, "dynamic": dyn, "seeds": len(rs)}
        for k in ("accuracy_at_common", "best_accuracy", "initial_accuracy", "wall_s", "train_tokens_per_s",
                  "head_staleness_mean", "head_staleness_max", "token_staleness_mean", *TB_MEANS):
            row[k] = _mean([r.get(k) for r in rs])  # fmt: skip
        row["accuracy_per_seed"] = [r["accuracy_at_common"] for r in rs]
        out.append(row)
    return common, out


def plot(rows: list[dict], common: int | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    plain = [r for r in rows if not r["dynamic"]]
    etas = sorted({r["eta"] for r in plain})
    x_of = {e: i for i, e in enumerate(etas)}  # evenly spaced: eta is roughly doubling
    eta0 = {r["loss"]: r for r in plain if r["eta"] == 0}
    for loss in dict.fromkeys(r["loss"] for r in plain):
        line = [r for r in plain if r["loss"] == loss]
        if loss == "ppo" and "decoupled_ppo" in eta0 and 0 not in {r["eta"] for r in line}:
            line = [eta0["decoupled_ppo"], *line]  # the same objective at eta 0
        line.sort(key=lambda r: r["eta"])
        xs = [x_of[r["eta"]] for r in line]
        ax.plot(xs, [r["accuracy_at_common"] for r in line], "o-", label=f"{loss} (mean)")
        for r in line:
            ax.scatter([x_of[r["eta"]]] * len(r["accuracy_per_seed"]), r["accuracy_per_seed"], s=12,
                       alpha=0.4, color=ax.lines[-1].get_color())  # fmt: skip
    for r in rows:
        if r["dynamic"] and r["eta"] in x_of:
            ax.scatter([x_of[r["eta"]]], [r["accuracy_at_common"]], marker="*", s=120, color="k",
                       label=f"{r['loss']} + dynamic sampling (mean)")  # fmt: skip
    ax.set_xticks(range(len(etas)), [str(e) for e in etas])
    ax.set_xlabel("staleness bound eta (0 = synchronous)")
    ax.set_ylabel(f"held-out accuracy at step {common}")
    ax.set_title("Accuracy vs staleness (configs/eta_sweep.py; dots: seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(rows: list[dict], common: int | None) -> str:
    f = lambda v, p=3: "" if v is None else f"{v:.{p}f}"
    head = (f"| eta | loss | acc @{common} (mean; per seed) | best | wall s | trained tok/s | head stale mean"
            " / max | token stale mean | clip low / high | IS truncated | IS w mean |")  # fmt: skip
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        name = r["loss"] + (" + dynamic sampling" if r["dynamic"] else "")
        seeds = ", ".join(f(a) for a in r["accuracy_per_seed"])
        lines.append(
            f"| {r['eta']} | {name} | {f(r['accuracy_at_common'])} ({seeds}) | {f(r['best_accuracy'])} | "
            f"{f(r['wall_s'], 0)} | {f(r['train_tokens_per_s'], 0)} | {f(r['head_staleness_mean'], 2)} / "
            f"{f(r['head_staleness_max'], 0)} | {f(r['token_staleness_mean'], 2)} | "
            f"{f(r.get('train/clip_low_frac'), 4)} / {f(r.get('train/clip_high_frac'), 4)} | "
            f"{f(r.get('train/behav_dropped_frac'), 4)} | {f(r.get('is_weight/mean'), 3)} |"
        )
    return "\n".join(lines)


def main(argv):
    del argv
    out = os.path.abspath(_OUT.value)
    os.makedirs(out, exist_ok=True)
    grid = cells([int(e) for e in _ETAS.value], _LOSSES.value, [int(s) for s in _SEEDS.value],
                 [int(e) for e in _DYNAMIC.value])  # fmt: skip
    if not _REPORT_ONLY.value:
        parallel = _PARALLEL.value or max(1, len(os.sched_getaffinity(0)) // _CORES.value)
        job = lambda c, steps, extra=(): (
            cell_command(c, os.path.join(out, c["name"]), steps, [*_SET.value, *extra]),
            os.path.join(out, c["name"] + ".log"),
        )
        # The warm start of each seed, once (cached under warm_start.cache_dir) before the cells race for it.
        loss0 = _LOSSES.value[0]
        warm = [dict(eta=0, loss=loss0, seed=s, dynamic=False, name=f"warm_s{s}") for s in _SEEDS.value]
        if _PREWARM.value:
            run_cells([job(c, 1, ["eval_every=0"]) for c in warm], parallel, _PIN.value, 0.0, _CORES.value)
        todo = [job(c, _STEPS.value) for c in grid]
        t0 = time.monotonic()
        run_cells(todo, parallel, _PIN.value, _DEADLINE.value, _CORES.value)
        print(f"{len(grid)} cells in {time.monotonic() - t0:.0f} s, {parallel} at a time", flush=True)
    results = [read_cell(c, os.path.join(out, c["name"])) for c in grid]
    for r in results:
        if "error" in r:
            print(f"cell {r['name']}: {r['error']}", file=sys.stderr)
        elif r.get("no_summary"):
            print(f"cell {r['name']}: no summary.json (it failed); results from its events", file=sys.stderr)
    common, rows = aggregate(results)
    report = {"steps": _STEPS.value, "common_eval_step": common, "cpus": len(os.sched_getaffinity(0)),
              "overrides": _SET.value, "settings": rows, "cells": results}  # fmt: skip
    with open(os.path.join(out, "eta_sweep.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    if rows:
        plot(rows, common, os.path.join(out, "eta_sweep.png"))
    print(table(rows, common))


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":
    run()
