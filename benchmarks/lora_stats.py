"""The LoRA-against-full study's design and statistics, shared by `benchmarks.lora_study` and its test (a
module here that is no command, so importing it defines no flags): the cells, each cell's config
overrides, picking LoRA's learning rate, the paired gap with its t interval, the verdict and the table.

A cell is one run: `full` (full fine-tuning at the config's own learning rate) or `lora` (rank r at a
given rate) for one seed. Seed s sets `config.seed` and `config.data.seed`, so a seed's cells share the
cached warm start, the data order and the sampling keys: the difference between them is the method.
"""

from __future__ import annotations

from benchmarks.eta_study import mean_ci, read_cell, run_mean

# The bar: LoRA at its best rate within this much of full fine-tuning's held-out accuracy.
BAND = 0.02


def cell(arm: str, seed: int, lr: float | None = None, rank: int | None = None) -> dict:
    """One run; `lr` and `rank` only for `lora` (full runs at the config's own rate)."""
    if arm == "full":
        return {"arm": "full", "seed": seed, "lr": None, "rank": None, "name": f"full_s{seed}"}
    if arm != "lora" or lr is None or rank is None:
        raise ValueError(f"a cell is 'full', or 'lora' with a rate and a rank: got {arm!r} {lr} {rank}")
    return {"arm": "lora", "seed": seed, "lr": lr, "rank": rank, "name": f"lora_r{rank}_lr{lr:g}_s{seed}"}


def overrides(c: dict, workdir: str, steps: int, eval_every: int | None) -> dict:
    """The config overrides of a cell: sync mode (no staleness to tell the methods apart), paired seeds."""
    values = {"workdir": workdir, "seed": c["seed"], "data.seed": c["seed"], "mode": "sync",
              "total_steps": steps}  # fmt: skip
    if eval_every is not None:  # None: the config's; 0: none (a warm-up run)
        values["eval_every"] = eval_every
    if c["arm"] == "lora":  # alpha: the config's (config.trainer.lora.alpha)
        values.update({"trainer.lora.enabled": True, "trainer.lora.rank": c["rank"], "trainer.lr": c["lr"]})
    return values


def read(c: dict, workdir: str, steps: int) -> dict:
    """A finished cell: its final held-out accuracy (the evaluation at `steps`), the mean over its
    evaluations after step 0 and, where the run scored it, its final expected reward (`final_er`, else
    None); an "error" entry when it did not reach `steps`."""
    r = read_cell(c, workdir)
    if "error" in r:
        return r
    if steps not in r["evals"]:
        return {**c, "error": f"no evaluation at step {steps} (last: {max(r['evals'])}; see {workdir}.log)"}
    final_er = r.get("expected", {}).get(steps)
    return {**r, "final": r["evals"][steps], "run_mean": run_mean(r["evals"], steps), "final_er": final_er}


def _ok(results: list[dict]) -> list[dict]:
    return [r for r in results if "error" not in r]


def pick_lr(results: list[dict], rank: int, pick_seeds: list[int]) -> float | None:
    """LoRA's best rate at `rank`: the highest mean final held-out accuracy over `pick_seeds`, among the
    rates every pick seed finished (ties: the lower rate). None when no rate has them all."""
    by_lr: dict[float, dict[int, float]] = {}
    for r in _ok(results):
        if r["arm"] == "lora" and r["rank"] == rank and r["seed"] in pick_seeds:
            by_lr.setdefault(r["lr"], {})[r["seed"]] = r["final"]
    full = {lr: sum(v.values()) / len(v) for lr, v in by_lr.items() if set(v) == set(pick_seeds)}
    return max(sorted(full), key=lambda lr: full[lr]) if full else None


def paired_gap(results: list[dict], rank: int, lr: float, field: str = "final") -> dict:
    """LoRA (rank, lr) minus full, seed by seed over the seeds where both finished and have `field`: mean,
    95% t interval."""
    ok = [r for r in _ok(results) if r.get(field) is not None]
    full = {r["seed"]: r[field] for r in ok if r["arm"] == "full"}
    lora = {r["seed"]: r[field] for r in ok if r["arm"] == "lora" and r["rank"] == rank and r["lr"] == lr}
    seeds = sorted(set(full) & set(lora))
    return {**mean_ci([lora[s] - full[s] for s in seeds]), "seeds": seeds}


def verdict(gap: dict) -> str:
    """The issue's call: within BAND when the gap's 95% interval lies above -BAND (LoRA may be better),
    short when it lies below -BAND, else unresolved (or too few seeds for an interval)."""
    if gap["lo"] is None:
        return f"too few paired seeds ({gap['n']})"
    if gap["lo"] >= -BAND:
        return f"within {BAND * 100:g} points"
    if gap["hi"] < -BAND:
        return f"more than {BAND * 100:g} points short"
    return f"unresolved (the interval spans -{BAND * 100:g} points)"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _arm(r: dict) -> str:
    return "full" if r["arm"] == "full" else f"LoRA r{r['rank']} lr {r['lr']:g}"


def table(results: list[dict], rank: int, best_lr: float | None, seeds: list[int]) -> str:
    """Markdown: per arm, each seed's final held-out accuracy (mean over the evaluations after step 0 in
    brackets) and their means; then LoRA-best minus full, paired, with the verdict."""
    arms: dict[str, dict[int, dict]] = {}
    for r in _ok(results):
        arms.setdefault(_arm(r), {})[r["seed"]] = r
    head = "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " | mean final | mean run-mean |"
    lines = [head, "|---" * (len(seeds) + 3) + "|"]
    for name, by_seed in arms.items():
        cells = [f"{_pct(by_seed[s]['final'])} ({_pct(by_seed[s]['run_mean'])})" if s in by_seed else "-"
                 for s in seeds]  # fmt: skip
        finals = [r["final"] for r in by_seed.values()]
        means = [r["run_mean"] for r in by_seed.values()]
        tail = f" | {_pct(sum(finals) / len(finals))} (n={len(finals)}) | {_pct(sum(means) / len(means))} |"
        lines.append(f"| {name} | " + " | ".join(cells) + tail)
    if best_lr is None:
        return "\n".join([*lines, "", "LoRA's best rate: not picked (a pick seed did not finish)."])
    lines.append("")
    for field in ("final", "run_mean", "final_er"):  # final_er: the final expected reward, where scored
        g = paired_gap(results, rank, best_lr, field)
        if field == "final_er" and not g["n"]:
            continue
        ci = "" if g["lo"] is None else f", 95% CI [{g['lo']:+.3f}, {g['hi']:+.3f}]"
        mean = "-" if g["mean"] is None else f"{g['mean']:+.3f}"
        lines.append(f"LoRA r{rank} lr {best_lr:g} minus full, {field}, paired over seeds {g['seeds']}: "
                     f"{mean}{ci}; verdict: {verdict(g)}")
    return "\n".join(lines)
