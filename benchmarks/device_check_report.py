"""Combines the stages written by benchmarks/device_check.sh into one JSON, with the peer bars checked.

python -m benchmarks.device_check_report DIR     # reads DIR/stages.json, DIR/<stage>.json, DIR/run/tb
"""

from __future__ import annotations

import json
import os

from absl import app

from jaxrl_async.cli import run_command
from jaxrl_async.runtime.metrics import SCALAR_TAGS, read_scalars

STAGES = ("env", "decode", "attention", "train_mfu", "train_memory", "sync_1p5b", "sync_8b", "run")
# The bars: 8B decode >= 70% of the HBM roofline at batch 1 (1k context) and >= 60% at batch 64
# with an 8k context; trainer MFU >= 40% at 4k-token rows; an 8B weight sync in one process <= 0.3 s.
BARS = {
    "decode_b1_1k_fraction_of_roofline": 0.70,
    "decode_b64_8k_fraction_of_roofline": 0.60,
    "train_mfu": 0.40,
    "weight_sync_8b_s": 0.3,
}


def _load(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _decode_fraction(decode: dict | None, batch: int, context: int):
    for p in (decode or {}).get("points", []):
        if p["batch"] == batch and p["context"] == context:
            return p.get("fraction_of_roofline")
    return None


def _checks(out_dir: str, attention: dict | None) -> dict:
    """Correctness, beside the speed bars: the run's attention agrees with the blocked path, forward and
    backward, padding included (device_probe's ATTENTION_GRAD_TOLERANCE), and the run skipped no step for a
    non-finite loss or gradient. None where the stage left nothing to judge."""
    checks = {
        f"attention_{layout.replace(' ', '_')}_agrees": res.get("agrees")
        for layout, res in (attention or {}).get("layouts", {}).items()
    }
    summary = _load(os.path.join(out_dir, "run", "summary.json"))
    checks["run_steps_finite"] = None if summary is None else summary.get("non_finite_steps", 0) == 0
    return checks


def report(out_dir: str) -> dict:
    parts = {name: _load(os.path.join(out_dir, f"{name}.json")) for name in STAGES if name != "run"}
    stages = _load(os.path.join(out_dir, "stages.json")) or {}
    tb = os.path.join(out_dir, "run", "tb")
    scalars = read_scalars(tb) if os.path.isdir(tb) else {}
    steps = max((s for series in scalars.values() for s, _ in series), default=0)
    run = {
        "tags_missing": [t for t in SCALAR_TAGS if t not in scalars],
        "last_step": steps,
        "eval_accuracy": scalars.get("eval/accuracy"),
    }
    sync = parts["sync_8b"]
    measured = {
        "decode_b1_1k_fraction_of_roofline": _decode_fraction(parts["decode"], 1, 1024),
        "decode_b64_8k_fraction_of_roofline": _decode_fraction(parts["decode"], 64, 8192),
        "train_mfu": (parts["train_mfu"] or {}).get("mfu"),
        "weight_sync_8b_s": sync and sync["colocated"]["sync_s"],
    }
    bars = {}
    for name, bar in BARS.items():
        value = measured[name]
        ok = None if value is None else (value <= bar if name.endswith("_s") else value >= bar)
        bars[name] = {"measured": value, "bar": bar, "met": ok}
    checks = _checks(out_dir, parts["attention"])
    return {"stages": stages, **parts, "run": run, "bars": bars, "checks": checks}


def main(argv) -> int:
    if len(argv) != 2:
        raise app.UsageError(f"one argument, the output directory of device_check.sh; got {argv[1:]}")
    out_dir = argv[1]
    if not os.path.isdir(out_dir):
        raise app.UsageError(f"{out_dir} is not a directory")
    res = report(out_dir)
    with open(os.path.join(out_dir, "device_check.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("stages", "run", "bars", "checks")}, indent=1))
    failed = [name for name, st in res["stages"].items() if st["rc"] != 0]
    absent = [name for name in STAGES if name not in res["stages"]]
    wrong = [name for name, ok in res["checks"].items() if ok is False]
    if failed or absent or res["run"]["tags_missing"] or wrong:
        missing = res["run"]["tags_missing"]
        print(f"device check incomplete: failed {failed}, not run {absent}, missing tags {missing}, "
              f"checks failed {wrong}")  # fmt: skip
        return 1
    return 0


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m benchmarks.device_check_report`
    run()
