"""What recording the schedule costs (config.record_schedule; docs/reproducibility.md), from finished runs.

  python -m benchmarks.bench_schedule_log --recorded DIR[,DIR] [--baseline DIR[,DIR]]

For each recorded run: its schedule's bytes per train step, and the recorder's own work timed again
here, per step: every record of the run encoded and written through `ScheduleWriter` (a local file,
flushed per record, as the run wrote it), and one parameter fingerprint of the run's final checkpoint
(one per version in the run). Their sum over the run's mean train-step interval is the slowdown the
recorder can cause when it sits on the critical path (it runs on the actor's and the learner's loops).
With --baseline (runs of the same config without the record) it also prints both kinds' mean step
intervals: on a busy machine their difference is mostly noise, which is why the direct figure is given.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import jax
from absl import flags

from jaxrl_async.cli import run_command
from jaxrl_async.runtime.checkpoint import load_policy
from jaxrl_async.runtime.schedule_log import ScheduleWriter, fingerprint, read_schedule
from jaxrl_async.sharding import SAMPLER_RULES, make_mesh

_RECORDED = flags.DEFINE_list("recorded", [], "Workdirs of runs made with config.record_schedule on.")
_BASELINE = flags.DEFINE_list("baseline", [], "Workdirs of the same runs without it (optional).")


def step_interval(workdir: str) -> float:
    """Mean seconds between the ends of train steps, after the first two (compiles, start-up)."""
    with open(os.path.join(workdir, "summary.json")) as f:
        spans = json.load(f)["step_spans"]
    ends = [end for _, _, end in spans][2:]
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def recorder_cost(workdir: str) -> dict:
    files = [
        os.path.join(workdir, "schedule", n) for n in sorted(os.listdir(os.path.join(workdir, "schedule")))
    ]
    records = {f: read_schedule(f) for f in files}
    steps = sum(1 for r in records[os.path.join(workdir, "schedule", "learner.jsonl")].records if "t" in r)
    total_bytes = sum(r.bytes for r in records.values())
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        for i, rec in enumerate(records.values()):
            w = ScheduleWriter(os.path.join(tmp, f"{i}.jsonl"))
            for r in rec.records:
                w.write(r)
            w.close()
        write_s = time.perf_counter() - t0
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    params = load_policy(workdir, mesh, SAMPLER_RULES)[1]
    fingerprint(params)  # compiles
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        fingerprint(params)
        times.append(time.perf_counter() - t0)
    fp_s = statistics.median(times)
    interval = step_interval(workdir)
    per_step = write_s / steps + fp_s
    return {"workdir": workdir, "steps": steps, "bytes_per_step": total_bytes / steps,
            "write_ms_per_step": 1e3 * write_s / steps, "fingerprint_ms": 1e3 * fp_s,
            "step_interval_s": interval, "cost_frac": per_step / interval}  # fmt: skip


def main(argv):
    del argv
    rows = [recorder_cost(w) for w in _RECORDED.value]
    for r in rows:
        print(f"{r['workdir']}: {r['steps']} steps, {r['bytes_per_step']:.0f} B/step, records written in "
              f"{r['write_ms_per_step']:.3f} ms/step, fingerprint {r['fingerprint_ms']:.3f} ms/version, "
              f"step interval {r['step_interval_s']:.3f} s: recorder cost {100 * r['cost_frac']:.3f}% of a "
              "step")  # fmt: skip
    if _BASELINE.value:
        on = [step_interval(w) for w in _RECORDED.value]
        off = [step_interval(w) for w in _BASELINE.value]
        a, b = statistics.mean(on), statistics.mean(off)
        print(f"mean step interval: recorded {a:.3f} s {on}, without {b:.3f} s {off} ({a / b - 1:+.1%})")


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":
    run()
