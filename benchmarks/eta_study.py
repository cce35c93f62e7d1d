"""The staleness study's design and statistics, shared by `benchmarks.eta_sweep` and its tests (a module here
that is no command, so importing it defines no flags): the arms, the grid of cells, each cell's config
overrides, reading a finished cell, paired differences with t intervals, the table and the plot.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

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


# The pre-registered decision rule (docs/results.md, "The lag-8 study"): on the paired gap to sync of the
# mean held-out expected reward, a staleness-aware arm is level if its 95% interval lies inside
# +-LEVEL_BAND, worse if it lies below -LEVEL_BAND; naive PPO is worse if its interval excludes 0 below.
LEVEL_BAND = 0.02


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
    # the drift split (docs/train.md): current-version tokens (sampler/trainer mismatch) and 8+ stale
    "drift/log_ratio/lag0",
    "drift/over_cap_frac/lag0",
    "drift/log_ratio/lag8_up",
    "drift/over_cap_frac/lag8_up",
)


def cell_done(workdir: str, steps: int) -> bool:
    """Whether the cell's summary.json shows at least `steps` train steps (a sweep's --skip-done)."""
    path = os.path.join(workdir, "summary.json")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return json.load(f).get("steps", 0) >= steps


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
    where = f"max_staleness{c['max_staleness']}" if c["max_staleness"] else f"lag{c['lag']}"
    return f"lr{c['lr']:g}_{where}_{c['arm']}_s{c['seed']}"


def cells(grid, max_staleness_values, arms, seeds) -> list[dict]:
    """Every cell: per rate, lag 0 runs the sync reference only, lags > 0 every arm; η cells every arm
    at the first rate; each for every seed."""
    for a in arms:
        if a not in ARMS:
            raise ValueError(f"--arms: unknown arm {a!r}; known: {sorted(ARMS)}")
    out = []
    for lr, lags in grid:
        for lag in lags:
            for arm in [SYNC] if lag == 0 else arms:
                out += [dict(lr=lr, lag=lag, max_staleness=0, arm=arm, seed=s) for s in seeds]
    for max_staleness in max_staleness_values:
        out += [dict(lr=grid[0][0], lag=0, max_staleness=max_staleness, arm=arm,
                     seed=s) for arm in arms for s in seeds]
    for c in out:
        c["name"] = _name(c)
    return out


def cell_overrides(cell: dict, workdir: str, steps: int) -> dict:
    """The config overrides of a cell. Everything a seed decides (init, warm start, data order, sampling
    keys) comes from `seed` and `data.seed` only, so the cells of one seed are paired."""
    arm = ARMS["decoupled_mask"] if cell["arm"] == SYNC else ARMS[cell["arm"]]
    values = {"workdir": workdir, "seed": cell["seed"], "data.seed": cell["seed"], "total_steps": steps,
              "trainer.lr": cell["lr"], **arm}  # fmt: skip
    if cell["max_staleness"]:
        values.update({"mode": "async", "max_staleness": cell["max_staleness"]})
    else:
        values.update({"mode": "sync", "trainer.controlled_lag": cell["lag"]})
    return values


def _tb_means(workdir: str) -> dict[str, float]:
    from jaxrl_async.runtime.metrics import read_scalars

    try:
        scalars = read_scalars(os.path.join(workdir, "tb"))
    except Exception:  # noqa: BLE001 - a cell without events reports none
        return {}
    return {k: float(np.mean([v for _, v in scalars[k]])) for k in TB_MEANS if scalars.get(k)}


def read_cell(cell: dict, workdir: str) -> dict:
    """A cell's evaluations (summary.json, else its TensorBoard events): held-out accuracy (`evals`) and,
    where the run scored it, expected reward (`expected`), each step -> value; and its diagnostics. An
    "error" entry when it has neither."""
    path = os.path.join(workdir, "summary.json")
    evals, expected, preempted = {}, {}, False
    if os.path.exists(path):
        with open(path) as f:
            summary = json.load(f)
        rows, preempted = summary.get("evals", []), bool(summary.get("preempted"))
        evals = {int(e["step"]): float(e["accuracy"]) for e in rows}
        expected = {int(e["step"]): float(e["expected_reward"]) for e in rows
                    if e.get("expected_reward") is not None}  # fmt: skip
    else:
        from jaxrl_async.runtime.metrics import read_scalars

        try:
            scalars = read_scalars(os.path.join(workdir, "tb"))
            evals = {int(s): float(a) for s, a in scalars["eval/accuracy"]}
            expected = {int(s): float(a) for s, a in scalars.get("eval/expected_reward", [])}
        except Exception:  # noqa: BLE001 - no events at all
            evals = {}
    if not evals or max(evals) == 0:  # nothing to compare: it stopped before its first evaluation
        return {**cell, "error": f"no evaluation after step 0 in {workdir} (see {workdir}.log)"}
    return {**cell, "evals": evals, "expected": expected, "no_summary": not os.path.exists(path),
            "preempted": preempted, **_tb_means(workdir)}  # fmt: skip


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


def mean_se(xs) -> dict:
    """Mean and standard error over seeds (None below two values)."""
    xs = np.asarray([x for x in xs if x is not None], np.float64)
    if xs.size == 0:
        return {"n": 0, "mean": None, "se": None}
    se = float(xs.std(ddof=1) / math.sqrt(xs.size)) if xs.size > 1 else None
    return {"n": int(xs.size), "mean": float(xs.mean()), "se": se}


def verdict(arm: str, gap: dict | None) -> str | None:
    """The pre-registered call on an arm's paired gap to sync (LEVEL_BAND); None for sync itself."""
    if arm == SYNC or not gap or gap["lo"] is None:
        return None
    if arm == NAIVE:
        return "worse" if gap["hi"] < 0 else "not shown worse"
    if -LEVEL_BAND <= gap["lo"] and gap["hi"] <= LEVEL_BAND:
        return "level"
    return "worse" if gap["hi"] < -LEVEL_BAND else "unresolved"


def run_mean(evals: dict[int, float], upto: int) -> float | None:
    """Mean accuracy over the run: the evaluations after step 0 up to step `upto`."""
    xs = [a for s, a in evals.items() if 0 < s <= upto]
    return float(np.mean(xs)) if xs else None


def collapsed(evals: dict[int, float], upto: int) -> bool:
    steps = [s for s in evals if s <= upto]
    return bool(steps) and evals[max(steps)] < evals.get(0, evals[min(steps)]) - COLLAPSE_DROP


def _setting(r: dict) -> tuple:
    return (r["lr"], r["lag"], r["max_staleness"])


def compare(results: list[dict], steps: int | None = None) -> dict:
    """Rows per (lr, lag, max_staleness, arm) with the paired comparisons; see the module docstring.
    A cell stopped early (SIGTERM at a deadline: its summary says preempted) or, with `steps`, whose last
    evaluation is before it, is left out, marked "incomplete", so a partial sweep compares finished cells
    at the step they all reached.

    Each row also has the expected-reward figures (`er_*`: the pre-registered metric, where every cell of
    the row scored it), the final evaluation's accuracy and expected reward (mean and standard error over
    seeds) and the pre-registered `verdict` on the expected reward's gap to sync."""
    for r in results:
        if "error" not in r and (r.get("preempted") or (steps is not None and max(r["evals"]) < steps)):
            r["incomplete"] = True
    ok = [r for r in results if "error" not in r and not r.get("incomplete")]
    common = min((max(r["evals"]) for r in ok), default=0)
    by = {(_setting(r), r["arm"], r["seed"]): r for r in ok}
    for r in ok:
        r["run_mean"], r["collapsed"] = run_mean(r["evals"], common), collapsed(r["evals"], common)
        er = r.get("expected") or {}
        r["er_run_mean"] = run_mean(er, common) if common in er else None
        r["final_accuracy"], r["final_er"] = r["evals"].get(common), er.get(common)
    rows = []
    for setting, arm in dict.fromkeys((_setting(r), r["arm"]) for r in ok):
        mine = [r for r in ok if _setting(r) == setting and r["arm"] == arm]
        naive = [(setting, NAIVE, r["seed"]) for r in mine]
        sync = [((r["lr"], 0, 0), SYNC, r["seed"]) for r in mine]
        row = {
            "lr": setting[0], "lag": setting[1], "max_staleness": setting[2], "arm": arm, "seeds": len(mine),
            "run_mean": mean_ci([r["run_mean"] for r in mine]),
            "vs_naive": None if arm in (NAIVE, SYNC) else mean_ci(_paired(mine, naive, by)),
            "gap_to_sync": None if arm == SYNC else mean_ci(_paired(mine, sync, by)),
            "collapses": sum(r["collapsed"] for r in mine),
            **{k: _mean([r.get(k) for r in mine]) for k in TB_MEANS},
            "er_run_mean": mean_ci([r["er_run_mean"] for r in mine]),
            "er_vs_naive": None if arm in (NAIVE, SYNC) else mean_ci(_paired(mine, naive, by, "er_run_mean")),
            "er_gap_to_sync": None if arm == SYNC else mean_ci(_paired(mine, sync, by, "er_run_mean")),
            "final_accuracy": mean_se([r["final_accuracy"] for r in mine]),
            "final_er": mean_se([r["final_er"] for r in mine]),
            "final_er_gap_to_sync": None if arm == SYNC else mean_ci(_paired(mine, sync, by, "final_er")),
        }  # fmt: skip
        row["verdict"] = verdict(arm, row["er_gap_to_sync"])
        rows.append(row)
    return {"common_eval_step": common, "rows": rows}


def _paired(mine: list[dict], keys: list[tuple], by: dict, field: str = "run_mean") -> list[float]:
    """Per seed, this cell's `field` minus that of the cell `keys` names (seeds without one are left out)."""
    pairs = [(r[field], by[k][field]) for r, k in zip(mine, keys, strict=True) if k in by]
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
    head = ("| lr | lag / η | arm | seeds | mean acc | arm - ppo [95% CI] | arm - sync [95% CI] | "
            "collapses | kl_behav | ESS | dropped | clip low / high | entropy | updates | token staleness |")
    lines = [head, "|" + "---|" * 15]
    for r in report["rows"]:
        where = f"max_staleness {r['max_staleness']}" if r["max_staleness"] else f"lag {r['lag']}"
        cols = [
            f"{r['lr']:g}", where, r["arm"], str(r["seeds"]), f(r["run_mean"]["mean"]), _ci(r["vs_naive"]),
            _ci(r["gap_to_sync"]), str(r["collapses"]), f(r["train/kl_behav"], 4), f(r["train/ess"]),
            f(r["train/behav_dropped_frac"], 4),
            f"{f(r['train/clip_low_frac'], 4)} / {f(r['train/clip_high_frac'], 4)}", f(r["train/entropy"]),
            f(r["train/updates"], 1), f(r["staleness/token_mean"], 2),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n\n" + preregistered_table(report) + "\n\n" + diagnostics_table(report)


def diagnostics_table(report: dict) -> str:
    """Per row, the means over steps and seeds the pre-registration asks for beside the verdict."""
    keys = ("train/kl_behav", "train/ess", "train/behav_dropped_frac", "train/offpolicy_masked_frac",
            "train/clip_low_frac", "train/clip_high_frac", "drift/log_ratio/lag0", "drift/over_cap_frac/lag0",
            "drift/log_ratio/lag8_up", "drift/over_cap_frac/lag8_up")  # fmt: skip
    lines = ["| lr | lag / η | arm | " + " | ".join(keys) + " |", "|" + "---|" * (3 + len(keys))]
    for r in report["rows"]:
        where = f"max_staleness {r['max_staleness']}" if r["max_staleness"] else f"lag {r['lag']}"
        vals = ["" if r.get(k) is None else f"{r[k]:.4f}" for k in keys]
        lines.append("| " + " | ".join([f"{r['lr']:g}", where, r["arm"], *vals]) + " |")
    return "\n".join(lines)


def _se(c: dict) -> str:
    if c["mean"] is None:
        return ""
    return f"{c['mean']:.3f}" + ("" if c["se"] is None else f" ± {c['se']:.3f}")


def preregistered_table(report: dict) -> str:
    """The pre-registered metric per row: mean held-out expected reward over the run, its paired gap to
    sync (95% t interval) and the verdict; the final evaluation's expected reward and accuracy (mean ±
    standard error over seeds) beside it."""
    lines = [f"Pre-registered metric (expected reward, evaluations 1..{report['common_eval_step']}):", "",
             "| lr | lag / η | arm | seeds | mean ER over run | arm - sync [95% CI] | verdict | "
             "final ER ± se | final ER - sync [95% CI] | final accuracy ± se |",
             "|" + "---|" * 10]  # fmt: skip
    for r in report["rows"]:
        where = f"max_staleness {r['max_staleness']}" if r["max_staleness"] else f"lag {r['lag']}"
        m = r["er_run_mean"]["mean"]
        cols = [f"{r['lr']:g}", where, r["arm"], str(r["seeds"]), "" if m is None else f"{m:.4f}",
                _ci(r["er_gap_to_sync"]), r["verdict"] or "", _se(r["final_er"]),
                _ci(r["final_er_gap_to_sync"]), _se(r["final_accuracy"])]  # fmt: skip
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = [r for r in report["rows"]
            if r["vs_naive"] and r["vs_naive"]["mean"] is not None and not r["max_staleness"]]
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
