"""The staleness study: paired seeds, controlled lag, five objectives, paired differences with 95% CIs.

  jaxrl-eta-sweep --out runs/eta_sweep --seeds 0,1,2,3,4,5,6,7 --steps 150

(or `python tools/eta_sweep.py ...`). Every cell is `jaxrl-run --config=configs/eta_sweep.py` with the
learning rate, the lag, the objective (an arm) and the seed overridden:

* **Controlled lag** (`trainer.controlled_lag = k`, mode sync): the sampler always holds the weights of
  version v - k, so every token of step v >= k is exactly k stale, in every arm alike; timing and
  admission no longer decide it. `--grid` gives the lags per learning rate (default: lags 0, 8, 32 at
  1e-4 and 0, 8 at 3e-4). At lag 0 the behaviour policy is the proximal one, so the arms' objectives
  coincide (up to M2PO's lack of a clip): one cell per seed, the `sync` reference, runs there.
* **eta admission** (`--etas`, a second factor): async cells with `max_staleness = eta` and no lag,
  every arm, at the first learning rate.
* **Paired seeds**: seed s sets `config.seed` and `config.data.seed`: the same warm start (computed once
  per seed, cached), the same data order and the same sampling keys (seed and admission number) in every
  arm of that seed.

The primary metric is each cell's mean held-out accuracy over the run (the evaluations after step 0, up
to the last one every cell reached), compared within a seed: the paired difference arm - `ppo` (naive
PPO against the stale behaviour policy) and arm - `sync` (the gap to lag 0), as a mean over seeds with a
95% t interval. A cell collapsed when its final accuracy is more than COLLAPSE_DROP below its start.
Per-arm diagnostics are the means of the cells' TensorBoard series (TB_MEANS).

Writes OUT/eta_sweep.json (cells, rows, comparisons) and OUT/eta_sweep.png (paired difference to naive
PPO against the lag), and prints markdown tables. --report-only rereads OUT's cells.
"""

from __future__ import annotations

import json
import math
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

# The objectives compared: name -> config overrides. "robust" combines the staleness options of
# jaxrl_async/trainer/losses.py on top of AReaL's masked decoupled PPO.
ARMS = {
    "ppo": {"trainer.loss": "ppo"},
    "decoupled_mask": {"trainer.loss": "decoupled_ppo", "trainer.behav_mode": "mask"},
    "decoupled_truncate": {"trainer.loss": "decoupled_ppo", "trainer.behav_mode": "truncate"},
    "m2po": {"trainer.loss": "m2po"},
    "robust": {
        "trainer.loss": "decoupled_ppo",
        "trainer.behav_mode": "mask",
        "trainer.offpolicy_seq_mask": 0.1,
        "trainer.ess_scaled_step": True,
    },  # fmt: skip
}
SYNC = "sync"  # the lag-0 reference cell: masked decoupled PPO, which lag 0 makes on-policy
NAIVE = "ppo"
COLLAPSE_DROP = 0.10  # final accuracy this far below the start: the cell collapsed

_OUT = flags.DEFINE_string("out", "runs/eta_sweep", "Directory for the cells' workdirs and the report.")
_CONFIG = flags.DEFINE_string("config", os.path.join(REPO, "configs", "eta_sweep.py"), "The cell config.")
_GRID = flags.DEFINE_string("grid", "1e-4:0,8,32;3e-4:0,8", "LR:LAGS;... controlled-lag cells per rate.")
_ETAS = flags.DEFINE_list("etas", [], "eta-admission cells (async, no lag) at the first rate of --grid.")
_ARMS = flags.DEFINE_list("arms", list(ARMS), f"Objectives (of {sorted(ARMS)}).")
_SEEDS = flags.DEFINE_list("seeds", [str(s) for s in range(8)], "Paired seeds (warm start, data, sampling).")
_STEPS = flags.DEFINE_integer("steps", 150, "Train steps per cell.")
_PARALLEL = flags.DEFINE_integer("parallel", 0, "Cells at a time; 0 = one per available CPU.")
_PIN = flags.DEFINE_bool("pin-cores", False, "Pin each running cell to cores of its own.")
_PROCESSES = flags.DEFINE_integer(
    "processes-per-cell",
    1,
    "2: each cell runs the learner and the sampler in processes of their own "
    "(jaxrl-local-cluster --pin-cores: a core each with --cores-per-cell 2), as on separate hosts.",
)
_CORES = flags.DEFINE_integer("cores-per-cell", 1, "With --pin-cores: cores per cell.")
_DEADLINE = flags.DEFINE_float("deadline-s", 0.0, "SIGTERM the cells still running after this; 0 = off.")
_SET = flags.DEFINE_multi_string("set", [], "KEY=VALUE config override for every cell (repeatable).")
_REPORT_ONLY = flags.DEFINE_bool("report-only", False, "Only reread OUT's cells and write the report.")
_PREWARM = flags.DEFINE_bool("prewarm", True, "Run each seed's warm start first (skip when it is cached).")

# Per-step TensorBoard scalars averaged over a cell's steps: the objectives' diagnostics.
TB_MEANS = (
    "train/kl_behav",
    "train/ess",
    "train/behav_dropped_frac",
    "train/offpolicy_masked_frac",
    "train/clip_low_frac",
    "train/clip_high_frac",
    "train/entropy",
    "train/updates",
    "staleness/token_mean",
)


def parse_grid(text: str) -> list[tuple[float, list[int]]]:
    """ "1e-4:0,8,32;3e-4:0,8" -> [(1e-4, [0, 8, 32]), (3e-4, [0, 8])]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        lr, _, lags = part.partition(":")
        try:
            out.append((float(lr), [int(x) for x in lags.split(",") if x.strip()]))
        except ValueError:
            raise ValueError(f"--grid: {part!r} is not LR:LAG,LAG,...") from None
        if not out[-1][1] or min(out[-1][1]) < 0:
            raise ValueError(f"--grid: {part!r} needs lags >= 0")
    return out


def _name(c: dict) -> str:
    where = f"eta{c['eta']}" if c["eta"] else f"lag{c['lag']}"
    return f"lr{c['lr']:g}_{where}_{c['arm']}_s{c['seed']}"


def cells(grid, etas, arms, seeds) -> list[dict]:
    """Every cell: per rate, lag 0 runs the sync reference only, lags > 0 every arm; eta cells every arm
    at the first rate; each for every seed."""
    for a in arms:
        if a not in ARMS:
            raise ValueError(f"--arms: unknown arm {a!r}; known: {sorted(ARMS)}")
    out = []
    for lr, lags in grid:
        for lag in lags:
            for arm in [SYNC] if lag == 0 else arms:
                out += [dict(lr=lr, lag=lag, eta=0, arm=arm, seed=s) for s in seeds]
    for eta in etas:
        out += [dict(lr=grid[0][0], lag=0, eta=eta, arm=arm, seed=s) for arm in arms for s in seeds]
    for c in out:
        c["name"] = _name(c)
    return out


def cell_overrides(cell: dict, workdir: str, steps: int) -> dict:
    """The config overrides of a cell. Everything a seed decides (init, warm start, data order, sampling
    keys) comes from `seed` and `data.seed` only, so the cells of one seed are paired."""
    arm = ARMS["decoupled_mask"] if cell["arm"] == SYNC else ARMS[cell["arm"]]
    values = {"workdir": workdir, "seed": cell["seed"], "data.seed": cell["seed"], "total_steps": steps,
              "trainer.lr": cell["lr"], **arm}  # fmt: skip
    if cell["eta"]:
        values.update({"mode": "async", "max_staleness": cell["eta"]})
    else:
        values.update({"mode": "sync", "trainer.controlled_lag": cell["lag"]})
    return values


def cell_command(cell: dict, workdir: str, steps: int, overrides: list[str], processes: int = 1) -> list[str]:
    values = cell_overrides(cell, workdir, steps)
    run_flags = [f"--config={_CONFIG.value}", *(f"--config.{k}={v}" for k, v in values.items())]
    run_flags += [f"--config.{kv}" for kv in overrides]
    if processes == 1:
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
    return {k: float(np.mean([v for _, v in scalars[k]])) for k in TB_MEANS if scalars.get(k)}


def read_cell(cell: dict, workdir: str) -> dict:
    """A cell's evaluations (summary.json, else its TensorBoard events) and diagnostics; an "error" entry
    when it has neither."""
    path = os.path.join(workdir, "summary.json")
    evals = {}
    if os.path.exists(path):
        with open(path) as f:
            evals = {int(e["step"]): float(e["accuracy"]) for e in json.load(f).get("evals", [])}
    else:
        from jaxrl_async.runtime.metrics import read_scalars

        try:
            evals = {int(s): float(a) for s, a in read_scalars(os.path.join(workdir, "tb"))["eval/accuracy"]}
        except Exception:  # noqa: BLE001 - no events at all
            evals = {}
    if not evals or max(evals) == 0:  # nothing to compare: it stopped before its first evaluation
        return {**cell, "error": f"no evaluation after step 0 in {workdir} (see {workdir}.log)"}
    return {**cell, "evals": evals, "no_summary": not os.path.exists(path), **_tb_means(workdir)}


def mean_ci(xs, level: float = 0.95) -> dict:
    """Mean and two-sided t confidence interval of a sample (None bounds below two values)."""
    from scipy import stats

    xs = np.asarray([x for x in xs if x is not None], np.float64)
    n = xs.size
    if n == 0:
        return {"n": 0, "mean": None, "lo": None, "hi": None}
    m = float(xs.mean())
    if n < 2:
        return {"n": 1, "mean": m, "lo": None, "hi": None}
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * float(xs.std(ddof=1)) / math.sqrt(n)
    return {"n": int(n), "mean": m, "lo": m - half, "hi": m + half}


def run_mean(evals: dict[int, float], upto: int) -> float | None:
    """Mean accuracy over the run: the evaluations after step 0 up to step `upto`."""
    xs = [a for s, a in evals.items() if 0 < s <= upto]
    return float(np.mean(xs)) if xs else None


def collapsed(evals: dict[int, float], upto: int) -> bool:
    steps = [s for s in evals if s <= upto]
    return bool(steps) and evals[max(steps)] < evals.get(0, evals[min(steps)]) - COLLAPSE_DROP


def _setting(r: dict) -> tuple:
    return (r["lr"], r["lag"], r["eta"])


def compare(results: list[dict]) -> dict:
    """Rows per (lr, lag, eta, arm) with the paired comparisons; see the module docstring."""
    ok = [r for r in results if "error" not in r]
    common = min((max(r["evals"]) for r in ok), default=0)
    by = {(_setting(r), r["arm"], r["seed"]): r for r in ok}
    for r in ok:
        r["run_mean"], r["collapsed"] = run_mean(r["evals"], common), collapsed(r["evals"], common)
    rows = []
    for setting, arm in dict.fromkeys((_setting(r), r["arm"]) for r in ok):
        mine = [r for r in ok if _setting(r) == setting and r["arm"] == arm]
        naive = [(setting, NAIVE, r["seed"]) for r in mine]
        sync = [((r["lr"], 0, 0), SYNC, r["seed"]) for r in mine]
        row = {
            "lr": setting[0], "lag": setting[1], "eta": setting[2], "arm": arm, "seeds": len(mine),
            "run_mean": mean_ci([r["run_mean"] for r in mine]),
            "vs_naive": None if arm in (NAIVE, SYNC) else mean_ci(_paired(mine, naive, by)),
            "gap_to_sync": None if arm == SYNC else mean_ci(_paired(mine, sync, by)),
            "collapses": sum(r["collapsed"] for r in mine),
            **{k: _mean([r.get(k) for r in mine]) for k in TB_MEANS},
        }  # fmt: skip
        rows.append(row)
    return {"common_eval_step": common, "rows": rows}


def _paired(mine: list[dict], keys: list[tuple], by: dict) -> list[float]:
    """Per seed, this cell's run mean minus that of the cell `keys` names (seeds without one are left out)."""
    pairs = [(r["run_mean"], by[k]["run_mean"]) for r, k in zip(mine, keys, strict=True) if k in by]
    return [a - b for a, b in pairs if a is not None and b is not None]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def _ci(c: dict | None) -> str:
    if not c or c["mean"] is None:
        return ""
    if c["lo"] is None:
        return f"{c['mean']:+.3f} (n=1)"
    return f"{c['mean']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]"


def table(report: dict) -> str:
    f = lambda v, p=3: "" if v is None else f"{v:.{p}f}"
    head = ("| lr | lag / eta | arm | seeds | mean acc | arm - ppo [95% CI] | arm - sync [95% CI] | "
            "collapses | kl_behav | ESS | dropped | clip low / high | entropy | updates | token staleness |")
    lines = [head, "|" + "---|" * 15]
    for r in report["rows"]:
        where = f"eta {r['eta']}" if r["eta"] else f"lag {r['lag']}"
        cols = [
            f"{r['lr']:g}", where, r["arm"], str(r["seeds"]), f(r["run_mean"]["mean"]), _ci(r["vs_naive"]),
            _ci(r["gap_to_sync"]), str(r["collapses"]), f(r["train/kl_behav"], 4), f(r["train/ess"]),
            f(r["train/behav_dropped_frac"], 4),
            f"{f(r['train/clip_low_frac'], 4)} / {f(r['train/clip_high_frac'], 4)}", f(r["train/entropy"]),
            f(r["train/updates"], 1), f(r["staleness/token_mean"], 2),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = [r for r in report["rows"] if r["vs_naive"] and r["vs_naive"]["mean"] is not None and not r["eta"]]
    for lr, arm in dict.fromkeys((r["lr"], r["arm"]) for r in rows):
        line = sorted((r for r in rows if (r["lr"], r["arm"]) == (lr, arm)), key=lambda r: r["lag"])
        xs = [r["lag"] for r in line]
        ys = [r["vs_naive"]["mean"] for r in line]
        err = [[y - (r["vs_naive"]["lo"] if r["vs_naive"]["lo"] is not None else y) for y, r in zip(ys, line,
               strict=True)], [(r["vs_naive"]["hi"] if r["vs_naive"]["hi"] is not None else y) - y
               for y, r in zip(ys, line, strict=True)]]  # fmt: skip
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"{arm}, lr {lr:g}")
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("controlled lag k (every token k versions stale)")
    ax.set_ylabel(f"mean accuracy over the run - naive PPO (to step {report['common_eval_step']})")
    ax.set_title("Paired difference to naive PPO, 95% CI over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv):
    del argv
    out = os.path.abspath(_OUT.value)
    os.makedirs(out, exist_ok=True)
    grid = parse_grid(_GRID.value)
    seeds = [int(s) for s in _SEEDS.value]
    todo_cells = cells(grid, [int(e) for e in _ETAS.value], _ARMS.value, seeds)
    if not _REPORT_ONLY.value:
        parallel = _PARALLEL.value or max(1, len(os.sched_getaffinity(0)) // _CORES.value)
        job = lambda c, steps, extra=(): (
            cell_command(c, os.path.join(out, c["name"]), steps, [*_SET.value, *extra], _PROCESSES.value),
            os.path.join(out, c["name"] + ".log"),
        )
        # Each seed's warm start, once (cached under warm_start.cache_dir) before the cells race for it.
        warm = [dict(lr=grid[0][0], lag=0, eta=0, arm=SYNC, seed=s, name=f"warm_s{s}") for s in seeds]
        if _PREWARM.value:
            run_cells([job(c, 1, ["eval_every=0"]) for c in warm], parallel, _PIN.value, 0.0, _CORES.value)
        t0 = time.monotonic()
        run_cells([job(c, _STEPS.value) for c in todo_cells], parallel, _PIN.value, _DEADLINE.value,
                  _CORES.value)  # fmt: skip
        print(f"{len(todo_cells)} cells in {time.monotonic() - t0:.0f} s, {parallel} at a time", flush=True)
    results = [read_cell(c, os.path.join(out, c["name"])) for c in todo_cells]
    for r in results:
        if "error" in r:
            print(f"cell {r['name']}: {r['error']}", file=sys.stderr)
        elif r.get("no_summary"):
            print(f"cell {r['name']}: no summary.json (it failed); results from its events", file=sys.stderr)
    cpus = len(os.sched_getaffinity(0))
    report = {"steps": _STEPS.value, "grid": _GRID.value, "etas": _ETAS.value, "cpus": cpus,
              "overrides": _SET.value, **compare(results), "cells": results}  # fmt: skip
    with open(os.path.join(out, "eta_sweep.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    if report["rows"]:
        plot(report, os.path.join(out, "eta_sweep.png"))
    print(table(report))


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":
    run()
