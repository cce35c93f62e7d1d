"""The staleness study: paired seeds, controlled lag, five objectives, paired differences with 95% CIs.

  python -m benchmarks.eta_sweep --out runs/eta_sweep --seeds 0,1,2,3,4,5,6,7 --steps 150

Every cell is `jaxrl-run --config=benchmarks/configs/eta_sweep.py` with the
learning rate, the lag, the objective (an arm) and the seed overridden:

* **Controlled lag** (`trainer.controlled_lag = k`, mode sync): the sampler always holds the weights of
  version v - k, so every token of step v >= k is exactly k stale, in every arm alike; timing and
  admission no longer decide it. `--grid` gives the lags per learning rate (default: lags 0, 8, 32 at
  1e-4 and 0, 8 at 3e-4). At lag 0 the behaviour policy is the proximal one, so the arms' objectives
  coincide (up to M2PO's lack of a clip): one cell per seed, the `sync` reference, runs there.
* **η admission** (`--max-staleness-cells`, a second factor): async cells with `max_staleness = η` and no lag,
  every arm, at the first learning rate.
* **Paired seeds**: seed s sets `config.seed` and `config.data.seed`: the same warm start (computed once
  per seed, cached), the same data order and the same sampling keys (seed and admission number) in every
  arm of that seed.

The primary metric is each cell's mean held-out accuracy over the run (the evaluations after step 0, up
to the last one every cell reached), compared within a seed: the paired difference arm - `ppo` (naive
PPO against the stale behaviour policy) and arm - `sync` (the gap to lag 0), as a mean over seeds with a
95% t interval. A cell collapsed when its final accuracy is more than COLLAPSE_DROP below its start.
The same figures for the held-out expected reward (the lag-8 study's pre-registered metric, with its
verdict: `eta_study.verdict`), and each arm's final evaluation (mean ± standard error over seeds).
Per-arm diagnostics are the means of the cells' TensorBoard series (TB_MEANS).

Cells run seed by seed (the next seed's warm start beside them), and OUT/eta_sweep.json is rewritten as
each cell ends: a sweep stopped by --deadline-s leaves whole paired seeds and a report of them (cells it
stopped mid-run are listed as incomplete and left out). --skip-done resumes a sweep.

Writes OUT/eta_sweep.json (cells, rows, comparisons) and OUT/eta_sweep.png (paired difference to naive
PPO against the lag), and prints markdown tables. --report-only rereads OUT's cells.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from absl import flags

from benchmarks.eta_study import (
    ARMS,
    SYNC,
    cell_done,
    cell_overrides,
    cells,
    compare,
    parse_grid,
    plot,
    read_cell,
    table,
)
from jaxrl_async.cli import REPO, command_env, module_command, run_command

# The checkout: configs/ is not part of the installed package.


_OUT = flags.DEFINE_string("out", "runs/eta_sweep", "Directory for the cells' workdirs and the report.")
_CONFIG = flags.DEFINE_string(
    "config", os.path.join(REPO, "benchmarks", "configs", "eta_sweep.py"), "The cell config."
)
_GRID = flags.DEFINE_string("grid", "1e-4:0,8,32;3e-4:0,8", "LR:LAGS;... controlled-lag cells per rate.")
_MAX_STALENESS_CELLS = flags.DEFINE_list("max-staleness-cells", [],
                                         "η-admission cells (async, no lag) at the first rate of --grid.")
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
_DEADLINE = flags.DEFINE_float("deadline-s", 0.0, "SIGTERM the cells still running this many seconds after "
                                "the first warm start began, start no more; 0 = off.")
_SET = flags.DEFINE_multi_string("set", [], "KEY=VALUE config override for every cell (repeatable).")
_REPORT_ONLY = flags.DEFINE_bool("report-only", False, "Only reread OUT's cells and write the report.")
_PREWARM = flags.DEFINE_bool("prewarm", True, "Run each seed's warm start first (skip when it is cached).")
_SKIP_DONE = flags.DEFINE_bool("skip-done", False,
                                "Do not rerun a cell whose summary.json shows all --steps (resume a sweep).")


def cell_command(cell: dict, workdir: str, steps: int, overrides: list[str], processes: int = 1) -> list[str]:
    values = cell_overrides(cell, workdir, steps)
    run_flags = [f"--config={_CONFIG.value}", *(f"--config.{k}={v}" for k, v in values.items())]
    run_flags += [f"--config.{kv}" for kv in overrides]
    if processes == 1:
        return module_command("run", *run_flags)
    run_flags += ["--config.mesh.trainer_processes=(0,)", "--config.mesh.sampler_processes=(1,)"]
    return module_command("local_cluster", "--num-processes", "2", "--pin-cores", "--", *run_flags)



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
              cores_per_cell: int = 1, on_done=None) -> None:  # fmt: skip
    """Runs (command, log path) pairs `parallel` at a time; with `pin`, each on a block of
    `cores_per_cell` cores (see core_block). `on_done(i)` is called as the i-th pair's process ends."""
    cpus = sorted(os.sched_getaffinity(0))
    started = 0
    running: dict[subprocess.Popen, tuple[int | None, object]] = {}
    t0, stopping = time.monotonic(), False
    queue = list(enumerate(todo))
    while queue or running:
        while queue and len(running) < parallel and not stopping:
            i, (cmd, log) = queue.pop(0)
            core = core_block(cpus, cores_per_cell, started) if pin else None
            started += 1
            pre = (lambda c=core: os.sched_setaffinity(0, c)) if core is not None else None
            f = open(log, "w")  # noqa: SIM115 - closed when the cell ends
            p = subprocess.Popen(cmd, env=command_env(), stdout=f, stderr=subprocess.STDOUT, preexec_fn=pre)
            running[p] = (core, f, i)
            print(f"[{time.monotonic() - t0:6.0f}s] start {os.path.basename(log)} core={core}", flush=True)
            time.sleep(0.2)  # staggered: each cell picks free localhost ports for its processes
        for p in [p for p in running if p.poll() is not None]:
            core, f, i = running.pop(p)
            f.close()
            name = os.path.basename(f.name)
            print(f"[{time.monotonic() - t0:6.0f}s] done  {name} rc={p.returncode}", flush=True)
            if on_done is not None:
                on_done(i)
        if deadline_s and not stopping and time.monotonic() - t0 > deadline_s:
            stopping = True  # the cells save and stop after their step in flight
            print(f"deadline: stopping {len(running)} cells, {len(queue)} never started", flush=True)
            for p in running:
                p.send_signal(signal.SIGTERM)
            queue.clear()
        time.sleep(0.5)


def main(argv):
    del argv
    out = os.path.abspath(_OUT.value)
    os.makedirs(out, exist_ok=True)
    grid = parse_grid(_GRID.value)
    seeds = [int(s) for s in _SEEDS.value]
    todo_cells = cells(grid, [int(e) for e in _MAX_STALENESS_CELLS.value], _ARMS.value, seeds)
    if not _REPORT_ONLY.value:
        parallel = _PARALLEL.value or max(1, len(os.sched_getaffinity(0)) // _CORES.value)
        job = lambda c, steps, extra=(): (
            cell_command(c, os.path.join(out, c["name"]), steps, [*_SET.value, *extra], _PROCESSES.value),
            os.path.join(out, c["name"] + ".log"),
        )
        # Each seed's warm start, once (cached under warm_start.cache_dir) before its cells race for it.
        warm = {s: dict(lr=grid[0][0], lag=0, max_staleness=0, arm=SYNC, seed=s, name=f"warm_s{s}")
                for s in seeds}  # fmt: skip
        warm_job = lambda s: (job(warm[s], 1, ["eval_every=0"]), None)
        t0 = time.monotonic()
        # Seed by seed (every arm of seed 0, then of seed 1, ...): a sweep stopped early (--deadline-s)
        # leaves whole paired seeds rather than every seed of the first arms and none of the last. The
        # next seed's warm start runs beside this seed's cells, so no core waits for it.
        done = lambda c: _SKIP_DONE.value and cell_done(os.path.join(out, c["name"]), _STEPS.value)
        todo = [c for c in todo_cells if not done(c)]
        stages = [[warm_job(seeds[0])]] if _PREWARM.value and seeds else []
        for i, seed in enumerate(seeds):
            stage = [(job(c, _STEPS.value), c) for c in todo if c["seed"] == seed]
            stages.append(stage + ([warm_job(seeds[i + 1])] if _PREWARM.value and i + 1 < len(seeds) else []))
        # Each finished cell is read once and the report rewritten at once, so whatever finished is
        # usable if the sweep is stopped.
        names = {c["name"] for c in todo}
        read = {c["name"]: read_cell(c, os.path.join(out, c["name"]))
                for c in todo_cells if c["name"] not in names}  # fmt: skip

        def finished(c: dict | None) -> None:
            if c is not None:
                read[c["name"]] = read_cell(c, os.path.join(out, c["name"]))
                write_report(out, todo_cells, read, plot_too=False, read_rest=False)

        for stage in stages:
            left = _DEADLINE.value - (time.monotonic() - t0) if _DEADLINE.value else 0.0
            if _DEADLINE.value and left <= 0:
                print("deadline: the remaining seeds never started", flush=True)
                break
            run_cells([j for j, _ in stage], parallel, _PIN.value, left, _CORES.value,
                      on_done=lambda i, stage=stage: finished(stage[i][1]))  # fmt: skip
        print(f"{len(todo)} cells in {time.monotonic() - t0:.0f} s, {parallel} at a time", flush=True)
    report = write_report(out, todo_cells, {}, plot_too=True, read_rest=True)
    print(table(report))


def write_report(out: str, todo_cells: list[dict], read: dict, plot_too: bool, read_rest: bool) -> dict:
    """OUT/eta_sweep.json from every cell: those in `read` as read already; the others read now
    (`read_rest`) or, while the sweep runs, reported as not finished."""
    unread = lambda c: (read_cell(c, os.path.join(out, c["name"])) if read_rest
                        else {**c, "error": "not finished yet"})  # fmt: skip
    results = [read.get(c["name"]) or unread(c) for c in todo_cells]
    for r in results if read_rest else []:  # while the sweep runs its log says which cells ended how
        if "error" in r:
            print(f"cell {r['name']}: {r['error']}", file=sys.stderr)
        elif r.get("no_summary"):
            print(f"cell {r['name']}: no summary.json (it failed); results from its events", file=sys.stderr)
    cpus = len(os.sched_getaffinity(0))
    steps = None if _REPORT_ONLY.value else _STEPS.value  # rereading: only preempted cells are incomplete
    report = {"steps": _STEPS.value, "grid": _GRID.value, "max_staleness_values": _MAX_STALENESS_CELLS.value,
              "cpus": cpus, "overrides": _SET.value, **compare(results, steps)}  # fmt: skip
    report.update(incomplete=[r["name"] for r in results if r.get("incomplete")], cells=results)
    tmp = os.path.join(out, "eta_sweep.json.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2, default=str)
    os.replace(tmp, os.path.join(out, "eta_sweep.json"))  # a reader never sees half a report
    if plot_too and report["rows"]:
        plot(report, os.path.join(out, "eta_sweep.png"))
    return report


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":
    run()
