"""Combines the parts written by tools/device_check.sh into one JSON, with the peer bars checked.

python tools/device_check_report.py DIR     # reads DIR/{decode,train,weight_sync}.json, DIR/run/tb
"""

from __future__ import annotations

import json
import os

from absl import app

from jaxrl_async.cli import run_command
from jaxrl_async.runtime.metrics import SCALAR_TAGS, read_scalars

# The peer bars: decode at >= 70% of HBM bandwidth at batch 1, train MFU >= 40%, a 1.5B weight
# sync in <= 0.5 s when colocated.
BARS = {"decode_b1_fraction_of_hbm": 0.70, "train_mfu": 0.40, "weight_sync_colocated_s": 0.5}


def _load(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def report(out_dir: str) -> dict:
    decode = _load(os.path.join(out_dir, "decode.json"))
    train = _load(os.path.join(out_dir, "train.json"))
    sync = _load(os.path.join(out_dir, "weight_sync.json"))
    stages = _load(os.path.join(out_dir, "stages.json")) or {}
    tb = os.path.join(out_dir, "run", "tb")
    scalars = read_scalars(tb) if os.path.isdir(tb) else {}
    steps = max((s for series in scalars.values() for s, _ in series), default=0)
    run = {
        "tags_missing": [t for t in SCALAR_TAGS if t not in scalars],
        "last_step": steps,
        "eval_accuracy": scalars.get("eval/accuracy"),
    }
    measured = {
        "decode_b1_fraction_of_hbm": decode and decode.get("b1_fraction_of_spec_roofline"),
        "train_mfu": train and train.get("mfu"),
        "weight_sync_colocated_s": sync and sync["colocated"]["sync_s"],
    }
    bars = {}
    for name, bar in BARS.items():
        value = measured[name]
        ok = None if value is None else (value <= bar if name.endswith("_s") else value >= bar)
        bars[name] = {"measured": value, "bar": bar, "met": ok}
    return {
        "stages": stages,
        "decode": decode,
        "train": train,
        "weight_sync": sync,
        "run": run,
        "bars": bars,
    }


def main(argv) -> int:
    if len(argv) != 2:
        raise app.UsageError(f"one argument, the output directory of tools/device_check.sh; got {argv[1:]}")
    out_dir = argv[1]
    if not os.path.isdir(out_dir):
        raise app.UsageError(f"{out_dir} is not a directory")
    res = report(out_dir)
    with open(os.path.join(out_dir, "device_check.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({"stages": res["stages"], "run": res["run"], "bars": res["bars"]}, indent=1))
    failed = [name for name, st in res["stages"].items() if st["rc"] != 0]
    if failed or res["run"]["tags_missing"] or len(res["stages"]) < 4:
        print(f"device check incomplete: failed stages {failed}, missing tags {res['run']['tags_missing']}")
        return 1
    return 0


def run() -> None:
    run_command(main, __name__)
