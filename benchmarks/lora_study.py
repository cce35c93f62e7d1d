"""LoRA against full fine-tuning on held-out accuracy: paired seeds, LoRA at its best learning rate.

  python -m benchmarks.lora_study --config configs/tiny_arith.py --out runs/lora_study/tiny_arith \
      --rank 8 --lrs 1e-3,2e-3,4e-3 --seeds 0,1,2 --pick-seeds 0 --steps 30 --eval-every 10

Every cell is `jaxrl-run --config=CONFIG` in sync mode for --steps (default: the config's total_steps):
full fine-tuning at the config's own learning rate on every seed, LoRA (--rank, the config's alpha) at
each of --lrs on the --pick-seeds. LoRA's best rate (the highest mean final held-out accuracy over the
pick seeds) then runs on the other seeds. Seed s sets `config.seed` and `config.data.seed`, so a seed's
cells share the cached warm start, data order and sampling keys (`benchmarks.lora_stats`).

Prints a markdown table (each seed's final held-out accuracy, with the mean over its evaluations after step
0 in brackets) and LoRA-best minus full, paired by seed, with its 95% t interval and the verdict against
2 points (`lora_stats.verdict`). Writes OUT/lora_study.json. --skip-done reuses cells whose summary.json
shows all --steps (resume); --report-only only rereads OUT.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time

from absl import flags

from benchmarks import lora_stats
from benchmarks.eta_study import cell_done
from jaxrl_async.cli import REPO, command_env, module_command, run_command

_CONFIG = flags.DEFINE_string("config", os.path.join(REPO, "configs", "tiny_arith.py"), "The config file.")
_OUT = flags.DEFINE_string("out", "runs/lora_study", "Directory for the cells' workdirs and the report.")
_RANK = flags.DEFINE_integer("rank", 8, "LoRA rank (alpha: the config's config.trainer.lora.alpha).")
_LRS = flags.DEFINE_list("lrs", ["1e-3", "2e-3", "4e-3"], "LoRA learning rates to pick from.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Paired seeds (warm start, data, sampling).")
_PICK = flags.DEFINE_list("pick-seeds", ["0"], "Seeds every LoRA rate runs on; the best rate is picked "
                          "by mean final held-out accuracy over them.")
_STEPS = flags.DEFINE_integer("steps", 0, "Train steps per cell; 0 = the config's total_steps.")
_EVAL_EVERY = flags.DEFINE_integer("eval-every", 0, "Steps between evaluations; 0 = the config's.")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "Cells at a time.")
_SET = flags.DEFINE_multi_string("set", [], "KEY=VALUE config override for every cell (repeatable).")
_SKIP_DONE = flags.DEFINE_bool("skip-done", False, "Reuse a cell whose summary.json shows all --steps.")
_PREWARM = flags.DEFINE_bool(
    "prewarm", True, "First a 1-step full run per seed, so each seed's warm start is cached before its cells "
    "start (otherwise parallel cells of one seed each compute it).")
_REPORT_ONLY = flags.DEFINE_bool("report-only", False, "Only reread OUT's cells and write the report.")


def config_steps(path: str) -> int:
    """The config file's total_steps (the default cell length)."""
    spec = importlib.util.spec_from_file_location("lora_study_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.get_config().total_steps)


def run_cells(cells: list[dict], out: str, steps: int, parallel: int, eval_every: int | None = None) -> None:
    """Runs the cells `parallel` at a time as `jaxrl-run` processes, each logging to OUT/NAME.log;
    `eval_every`: --eval-every's unless given."""
    eval_every = (_EVAL_EVERY.value or None) if eval_every is None else eval_every
    queue, running, t0 = list(cells), {}, time.monotonic()
    while queue or running:
        while queue and len(running) < parallel:
            c = queue.pop(0)
            workdir = os.path.join(out, c["name"])
            values = lora_stats.overrides(c, workdir, steps, eval_every)
            cmd = module_command("run", f"--config={_CONFIG.value}",
                                 *(f"--config.{k}={v}" for k, v in values.items()),
                                 *(f"--config.{kv}" for kv in _SET.value))  # fmt: skip
            log = open(workdir + ".log", "w")  # noqa: SIM115 - closed when the cell ends
            running[subprocess.Popen(cmd, env=command_env(), stdout=log, stderr=subprocess.STDOUT)] = (c, log)
            print(f"[{time.monotonic() - t0:6.0f}s] start {c['name']}", flush=True)
        for p in [p for p in running if p.poll() is not None]:
            c, log = running.pop(p)
            log.close()
            print(f"[{time.monotonic() - t0:6.0f}s] done  {c['name']} rc={p.returncode}", flush=True)
        time.sleep(1.0)


def report(out: str, cells: list[dict], steps: int, seeds: list[int], pick: list[int]) -> tuple[list, float]:
    """Reads every cell, picks LoRA's rate, writes OUT/lora_study.json; returns (results, best rate)."""
    results = [lora_stats.read(c, os.path.join(out, c["name"]), steps) for c in cells]
    best = lora_stats.pick_lr(results, _RANK.value, pick)
    fields = ("final", "run_mean") if best else ()
    gaps = {f: lora_stats.paired_gap(results, _RANK.value, best, f) for f in fields}
    doc = {"config": _CONFIG.value, "steps": steps, "rank": _RANK.value, "lrs": _LRS.value, "seeds": seeds,
           "pick_seeds": pick, "overrides": _SET.value, "best_lr": best,
           "gaps": {f: {**g, "verdict": lora_stats.verdict(g)} for f, g in gaps.items()},
           "cells": results}  # fmt: skip
    tmp = os.path.join(out, "lora_study.json.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, default=str)
    os.replace(tmp, os.path.join(out, "lora_study.json"))
    return results, best


def main(argv):
    del argv
    out = os.path.abspath(_OUT.value)
    os.makedirs(out, exist_ok=True)
    steps = _STEPS.value or config_steps(_CONFIG.value)
    seeds, pick = [int(s) for s in _SEEDS.value], [int(s) for s in _PICK.value]
    if not set(pick) <= set(seeds):
        raise ValueError(f"--pick-seeds {pick} must be among --seeds {seeds}")
    lrs = [float(x) for x in _LRS.value]
    first = [lora_stats.cell("full", s) for s in seeds]
    first += [lora_stats.cell("lora", s, lr, _RANK.value) for s in pick for lr in lrs]
    done = lambda c: _SKIP_DONE.value and cell_done(os.path.join(out, c["name"]), steps)
    todo = lambda cs: [c for c in cs if not done(c)]
    if not _REPORT_ONLY.value:
        if _PREWARM.value:  # one 1-step full run per seed about to run, unevaluated (eval_every=0)
            seeds_to_run = sorted({c["seed"] for c in todo(first)})
            warm = [{**lora_stats.cell("full", s), "name": f"warm_s{s}"} for s in seeds_to_run]
            warm = [c for c in warm if not cell_done(os.path.join(out, c["name"]), 1)]
            run_cells(warm, out, 1, _PARALLEL.value, eval_every=0)
        run_cells(todo(first), out, steps, _PARALLEL.value)
    _, best = report(out, first, steps, seeds, pick)
    rest = [lora_stats.cell("lora", s, best, _RANK.value) for s in seeds if s not in pick] if best else []
    if rest and not _REPORT_ONLY.value:
        print(f"LoRA's best rate on seeds {pick}: {best:g}", flush=True)
        run_cells(todo(rest), out, steps, _PARALLEL.value)
    results, best = report(out, first + rest, steps, seeds, pick)
    for r in results:
        if "error" in r:
            print(f"cell {r['name']}: {r['error']}")
    print(f"{_CONFIG.value}, {steps} steps, sync, LoRA rank {_RANK.value}:\n")
    print(lora_stats.table(results, _RANK.value, best, seeds))


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":
    run()
