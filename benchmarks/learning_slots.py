"""bench_learning's engine-size sweep: each mode's `sampler.num_slots` at its best before the learning runs.

A slotted engine's decode step costs about the same at any occupancy and grows with its slot count, so sync,
which drains each batch to its last token, wants fewer slots than async, which keeps them full: comparing
the modes at one engine size tilts the result (docs/results.md, "Sync vs async"). `--slot-sweep` probes
each mode at each value with a short run of the first seed (no evaluation, the first fifth of its steps
left out of the steady rate as in every run), and the learning runs then use each mode's best.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxrl_async.perf.report import best_against_best

# What a probe leaves out: evaluations (their engine is sized by eval_slots, not by the swept value) and
# anything written that the rate does not need.
PROBE = {"eval_every": "0", "text_samples": "0", "checkpoint_every": "0", "checkpoint_minutes": "0.0"}


def parse(values: list[str]) -> list[int]:
    """--slot-sweep's values, distinct and positive; an error names the flag."""
    try:
        slots = [int(v) for v in values]
    except ValueError:
        raise ValueError(f"--slot-sweep: comma-separated integers, got {values}") from None
    if any(s < 1 for s in slots) or len(set(slots)) != len(slots):
        raise ValueError(f"--slot-sweep: distinct positive slot counts, got {values}")
    return slots


def sweep(modes: tuple[str, ...], slots: list[int], probe: Callable[[str, int], dict]) -> dict:
    """Runs `probe(mode, slots)` (a run's summary.json) for every mode and value; returns {"runs": {mode:
    {slots: {steady_train_tokens_per_s, completion_length_p50, ...}}}, "best": {mode: {slots, ...,
    over_sync_best}}}."""
    keys = ("steady_train_tokens_per_s", "steady_sampler_idle_frac", "steady_trainer_idle_frac",
            "completion_length_p50", "completion_length_p99", "staleness_max")  # fmt: skip
    runs: dict[str, dict[int, dict]] = {}
    for mode in modes:
        for n in slots:
            summary = probe(mode, n)
            runs.setdefault(mode, {})[n] = {k: summary.get(k) for k in keys}
    return {"runs": runs, "best": best_against_best(runs)}


def table(result: dict) -> str:
    """The sweep as a markdown table: a row per mode, a column per slot count, each mode's best in bold."""
    slots = sorted({n for runs in result["runs"].values() for n in runs})
    lines = ["| trained tok/s (steady) | " + " | ".join(f"{n} slots" for n in slots) + " |",
             "|" + "---|" * (len(slots) + 1)]  # fmt: skip
    for mode, runs in result["runs"].items():
        best = result["best"][mode]["slots"]
        cells = []
        for n in slots:
            rate = runs.get(n, {}).get("steady_train_tokens_per_s")
            text = "" if rate is None else f"{rate:,.0f}"
            cells.append(f"**{text}**" if n == best and text else text)
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
