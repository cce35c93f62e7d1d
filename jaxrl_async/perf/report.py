"""Report of a split sweep: a text table, report.json and PNG plots (matplotlib Agg)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from jaxrl_async.perf.latency import DecodeBench, DecodeLatency
from jaxrl_async.perf.model import SplitResult
from jaxrl_async.perf.simulator import SimResult
from jaxrl_async.perf.system import System
from jaxrl_async.perf.workload import EmpiricalLengths, LengthDist


def _rows_to_show(results: list[SplitResult], max_rows: int) -> list[SplitResult]:
    """Every split when few; else an even stride plus the best split and the edges of the feasible set."""
    if len(results) <= max_rows:
        return results
    keep = set(range(0, len(results), -(-len(results) // max_rows))) | {len(results) - 1}
    ok = [i for i, r in enumerate(results) if r.feasible]
    if ok:
        keep |= {ok[0], ok[-1], max(ok, key=lambda i: results[i].tokens_per_s)}
    return [results[i] for i in sorted(keep)]


def format_table(results: list[SplitResult], sync: SplitResult, max_rows: int = 40) -> str:
    """One line per split (a subset when there are many) plus the sync baseline."""
    head = (
        f"{'sampler':>7} {'trainer':>7} {'tok/s':>11} {'vs sync':>7} {'bound':>9} {'step_s':>8} "
        f"{'period_s':>8} {'max_st':>6} {'mean_st':>7} {'imbal':>5}  note"
    )
    lines = [head, "-" * len(head)]
    for r in _rows_to_show(results, max_rows):
        lines.append(
            f"{r.sampler_devices:>7} {r.trainer_devices:>7} {r.tokens_per_s:>11.4g} "
            f"{r.tokens_per_s / sync.tokens_per_s:>6.2f}x {r.bottleneck:>9} {r.train_step_s:>8.3g} "
            f"{r.period_s:>8.3g} {r.max_staleness:>6.2f} {r.mean_staleness:>7.2f} {r.imbalance:>5.0%}  "
            f"{'ok' if r.feasible else r.reason}"
        )
    lines.append(
        f"{'sync':>7} {sync.trainer_devices:>7} {sync.tokens_per_s:>11.4g} {1:>6.2f}x {'sync':>9} "
        f"{sync.train_step_s:>8.3g} {sync.period_s:>8.3g}"
    )
    return "\n".join(lines)


def _lengths_summary(dist: LengthDist) -> dict[str, Any]:
    if isinstance(dist, EmpiricalLengths):
        return {"kind": "empirical", "n": len(dist.values), "max": dist.max_len}
    return dist.to_dict()


def _system_summary(system: System) -> dict[str, Any]:
    wl, sp = system.workload, system.sampler
    return {
        "total_devices": system.total_devices,
        "max_staleness": system.max_staleness,
        "samples_per_batch": wl.samples_per_batch,
        "prompt_len": wl.prompt_len,
        "mean_response_len": wl.lengths.mean(),
        "expected_max_response_len": wl.lengths.expected_max(wl.samples_per_batch),
        "lengths": _lengths_summary(wl.lengths),
        "sampler": {
            "devices_per_replica": sp.devices_per_replica,
            "max_batch": sp.max_batch,
            "prefill_s": sp.prefill_s,
            "update_s": sp.update_s,
            "latency": dataclasses.asdict(sp.latency),
        },
        "trainer": dataclasses.asdict(system.trainer),
    }


def build_report(
    system: System,
    results: list[SplitResult],
    sync: SplitResult,
    best: SplitResult | None,
    sims: dict[str, SimResult] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """report.json content: best split, sync baseline, speedup, the whole sweep and optional sims."""
    report: dict[str, Any] = {
        "system": _system_summary(system),
        "best": best.to_dict() if best else None,
        "sync": sync.to_dict(),
        "speedup": best.tokens_per_s / sync.tokens_per_s if best else None,
        "sweep": [r.to_dict() for r in results],
    }
    if sims:
        report["simulated"] = {k: dataclasses.asdict(v) for k, v in sims.items()}
        if "best" in sims and "sync" in sims:
            report["simulated"]["speedup"] = sims["best"].tokens_per_s / sims["sync"].tokens_per_s
    if extra:
        report.update(extra)
    return report


def write_report(out_dir: str, report: dict[str, Any]) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "report.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2, allow_nan=False, default=float)
    return path


def plot_sweep(path: str, results: list, sync, max_staleness: int, ylabel: str = "response tokens / s",
               best=None) -> list[str]:  # fmt: skip
    """Throughput and staleness against the number of sampler devices (SplitResult-like rows), with the
    chosen split `best` (one of `results`) marked and the sync baseline's value written on its line.
    Returns the throughput panel's legend entries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = np.array([r.sampler_devices for r in results])
    tps = np.array([r.tokens_per_s for r in results])
    ok = np.array([r.feasible for r in results])
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    ax1.plot(s, tps, "-", color="C0", label="async (all splits)")
    ax1.plot(s[ok], tps[ok], "o", color="C0", label="async (feasible)")
    ax1.axhline(sync.tokens_per_s, color="C3", ls="--", label=f"sync, all devices: {sync.tokens_per_s:.4g}")
    if best is not None:
        speedup = best.tokens_per_s / sync.tokens_per_s if sync.tokens_per_s else float("nan")
        label = (f"chosen: {best.sampler_devices} sampler / {best.trainer_devices} trainer, "
                 f"{best.tokens_per_s:.4g} ({speedup:.2f}x sync)")  # fmt: skip
        ax1.plot([best.sampler_devices], [best.tokens_per_s], "*", color="C2", ms=16, label=label)
        ax2.axvline(best.sampler_devices, color="C2", ls=":", lw=1)
    ax1.set_ylabel(ylabel)
    ax1.legend(fontsize=8)
    ax2.plot(s, [r.max_staleness for r in results], "-o", label="max staleness (longest sample / period)")
    ax2.plot(s, [r.mean_staleness for r in results], "-s", label="mean staleness (closed form)")
    ax2.axhline(max_staleness, color="k", ls=":", label=f"η = {max_staleness}")
    ax2.set_xlabel(f"sampler devices (of {results[0].sampler_devices + results[0].trainer_devices})")
    ax2.set_ylabel("versions")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    labels = [t.get_text() for t in ax1.get_legend().get_texts()]
    plt.close(fig)
    return labels


def plot_latency(path: str, latency: DecodeLatency, bench: DecodeBench | None, max_batch: int) -> None:
    """The decode latency curve t(b), with the measured points it was fitted to."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hi = max(max_batch, max(bench.batch) if bench else 1)
    b = np.unique(np.geomspace(1, hi, 200))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(b, latency.step_s(b) * 1e3, "-", label="roofline t(b)")
    if bench:
        ax.plot(bench.batch, np.array(bench.step_s) * 1e3, "o", label="measured")
    ax.axvline(max_batch, color="k", ls=":", label=f"KV cap = {max_batch}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("decode batch")
    ax.set_ylabel("step time (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def best_against_best(sweep: dict[str, dict[int, dict]]) -> dict[str, dict]:
    """Each mode's best slot count (highest steady trained tokens/s) and its ratio to sync's best:
    benchmarks.bench_async's best against best, from a sweep {mode: {slots: run summary}}."""
    best = {}
    for mode, runs in sweep.items():
        slots = max(runs, key=lambda s: runs[s]["steady_train_tokens_per_s"])
        best[mode] = {"slots": slots, **runs[slots]}
    base = best.get("sync", {}).get("steady_train_tokens_per_s")
    for b in best.values():
        b["over_sync_best"] = b["steady_train_tokens_per_s"] / base if base else None
    return best
