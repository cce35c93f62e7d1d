"""Sync vs async RL throughput on one long-tailed workload, same engine and devices, in one run.

Each prompt's generation cap is drawn from a lognormal (median, p99) and the stop token is disabled, so
completion lengths follow that distribution exactly; both modes see the same prompts and lengths.

  python tools/bench_async.py --steps 30 --out /tmp/bench_async.json             # the documented run
  python tools/bench_async.py --steps 30 --slots 64                               # engine sized to one batch

Prints a JSON summary and a table: steady-state trained tokens/s (after the first fifth of the steps),
sampler and trainer idle fractions, head/token staleness, and the async/sync ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lognormal_caps(median: float, p99: float, max_len: int, seed: int):
    """prompt index -> generation cap, lognormal with the given median and p99 (clipped to [1, max_len])."""
    import numpy as np

    sigma = math.log(p99 / median) / 2.3263478740408408  # z of the 99th percentile

    def cap(index: int) -> int:
        rng = np.random.default_rng((seed, index))
        return int(np.clip(round(median * math.exp(sigma * rng.standard_normal())), 1, max_len))

    return cap


def make_config(args, mode: str, workdir: str):
    from configs import tiny_arith

    c = tiny_arith.get_config()
    c.workdir = workdir
    c.mode = mode
    c.max_staleness = args.eta
    c.total_steps = args.steps
    c.prompts_per_step = args.prompts
    c.samples_per_prompt = args.samples
    c.eval_every = 0
    c.eval_prompts = 8
    c.text_samples = 0
    c.model.preset = args.model
    c.model.n_layers = args.layers
    c.mesh.sampler = (args.sampler_devices, 1)
    c.mesh.trainer = (args.trainer_devices, 1)
    c.warm_start.enabled = False
    c.data.reward = "format"  # throughput only: "contains a digit" keeps every group's gradient non-zero
    c.reward.defaults = {"format_regex": "[0-9]"}
    c.sampler.num_slots = args.slots
    c.sampler.max_new_tokens = args.max_len
    c.sampler.stop_tokens = (-1,)  # never sampled: lengths are exactly the drawn caps
    c.trainer.token_budget = args.token_budget
    c.trainer.rows_per_micro = args.rows
    c.trainer.lr = 1e-5
    c.trainer.skip_zero_advantage = False  # throughput of the full batch, whatever the rewards
    return c


def run_mode(args, mode: str) -> dict:
    from jaxrl_async.orchestrator import Orchestrator
    from jaxrl_async.setup import build_setup

    with tempfile.TemporaryDirectory() as workdir:
        setup = build_setup(make_config(args, mode, workdir))
        try:
            caps = lognormal_caps(args.median, args.p99, args.max_len, seed=1)
            return Orchestrator(setup, max_new_tokens_fn=caps).run()
        finally:
            setup.close()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--median", type=float, default=24)
    p.add_argument("--p99", type=float, default=96)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--eta", type=int, default=4)
    p.add_argument("--model", default="tiny")
    p.add_argument("--layers", type=int, default=2, help="layer count (0 = the preset's)")
    p.add_argument("--sampler-devices", type=int, default=2)
    p.add_argument("--trainer-devices", type=int, default=2)
    p.add_argument("--token-budget", type=int, default=256)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--out", default="")
    args = p.parse_args()

    from jaxrl_async.launch_util import prepare_devices

    class _Mesh:  # prepare_devices reads config.mesh.fake_cpu_devices
        mesh = type("m", (), {"fake_cpu_devices": 8})

    prepare_devices(_Mesh)
    results = {mode: run_mode(args, mode) for mode in ("sync", "async")}
    keys = (
        "steady_train_tokens_per_s",
        "train_tokens_per_s",
        "sample_tokens_per_s",
        "sampler_idle_frac",
        "trainer_idle_frac",
        "staleness_mean",
        "staleness_max",
        "token_staleness_mean",
        "wall_s",
    )
    table = {m: {k: results[m][k] for k in keys} for m in results}
    ratio = table["async"]["steady_train_tokens_per_s"] / max(
        table["sync"]["steady_train_tokens_per_s"], 1e-9
    )
    out = {"workload": vars(args), "results": table, "async_over_sync": ratio}
    print(json.dumps(out, indent=2))
    print(f"\n| metric | sync | async (eta={args.eta}) |\n|---|---|---|")
    for k in keys:
        print(f"| {k} | {table['sync'][k]:.3g} | {table['async'][k]:.3g} |")
    print(f"| async / sync trained tokens/s | | {ratio:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
