"""The staleness-window regime, checked against a real run: does the split model predict it?

  python tools/window_check.py --out /tmp/window_check.json

A workload whose throughput the η window bounds (η = 1, a long tail p99/median = 8, a fast trainer) runs
as two processes pinned to separate cores (learner on core 0, sampler on core 1). Before it, on one core:
the engine's decode step time with b busy slots of the run's engine, and with an engine of only b slots
(the t(b) the split model assumes when every busy slot costs, i.e. a paged engine); the trainer's step
time from tools/bench_roles.py. The split model (jaxrl_async.perf.model) and the simulator then predict
the run's trained tokens/s twice: charging t(busy slots) per decode step, and t(all slots) (a
static-shape engine, `Sampler.static_batch`), beside what the run measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.bench_async import config_flags, role_bench  # noqa: E402  (one definition of the workload)

BATCHES = (1, 4, 16, 64, 256)
KEYS = (
    "steady_train_tokens_per_s",
    "sampler_idle_frac",
    "trainer_idle_frac",
    "staleness_mean",
    "staleness_max",
)


def _decode_times(args, out: str) -> None:
    """Decode step seconds on one core: the run's engine with b busy slots, and b-slot engines."""
    code = f"""
import json, dataclasses, jax
from configs import bench_async
from jaxrl_async.calibration import decode_step_s
from jaxrl_async.model import init_params
from jaxrl_async.orchestrator import single_process
from jaxrl_async import setup as build
from jaxrl_async.weight_sync import WeightSync
c = bench_async.get_config()
c.workdir = {out!r} + ".d"; c.model.n_layers = {args.layers}; c.sampler.num_slots = {args.slots}
c.sampler.max_new_tokens = {args.max_len}
from jaxrl_async.launch_util import prepare_devices
prepare_devices(c)
run = build.validate_for(c, single_process())
tok = build.build_tokenizer(run); cfg = build.model_config(run, tok); scfg = build.sampler_config(run, tok)
mesh = build.sampler_mesh(run, single_process())
params = WeightSync(cfg, mesh)(init_params(cfg, jax.random.key(0)))
engine = build.build_engines(run, cfg, mesh, scfg)[0]
engine.update_params(params, 0)
res = {{"slots": {args.slots}, "busy_of_run_engine": [], "engine_of_b_slots": []}}
for b in {list(BATCHES)!r}:
    if b <= {args.slots}:
        res["busy_of_run_engine"].append([b, decode_step_s(engine, b)])
        few = dataclasses.replace(scfg, num_slots=b, token_budget=b * scfg.slot_len)
        small = build.build_engines(run, cfg, mesh, few)[0]
        small.update_params(params, 0)
        res["engine_of_b_slots"].append([b, decode_step_s(small, b)])
json.dump(res, open({out!r}, "w"))
"""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    core = sorted(os.sched_getaffinity(0))[:1]
    subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        check=True,
        cwd=REPO,
        preexec_fn=lambda: os.sched_setaffinity(0, core),
    )


def predict(args, decode: dict, roles: dict, static: bool) -> dict:
    from jaxrl_async.perf import model as pm
    from jaxrl_async.perf.latency import fit_decode_latency
    from jaxrl_async.perf.simulator import simulate
    from jaxrl_async.perf.system import Sampler, System, Trainer
    from jaxrl_async.perf.workload import LogNormalLengths, Workload

    b, t = zip(*decode["engine_of_b_slots"], strict=True)
    latency = fit_decode_latency(b, t)
    prompt_len = roles["tokens_per_batch"] / roles["samples_per_batch"] - roles["completion_length_mean"]
    wl = Workload(
        args.prompts, args.samples, round(prompt_len), LogNormalLengths(args.median, args.p99, args.max_len)
    )
    tps = roles["tokens_per_batch"] / roles["train_step_s"]
    sampler = Sampler(latency, 1, args.slots, 0.0, roles["update_s"], static_batch=static)
    system = System(2, sampler, Trainer(tps, 1, 0.0), wl, args.eta)
    a = pm.analyze_split(system, 1, 1)
    sim = simulate(system, 1, 1, steps=200, warmup=20, seed=0)
    to_trained = (prompt_len + wl.lengths.mean()) / wl.lengths.mean()  # response -> prompt + response tokens
    return {
        "model_tokens_per_s": a.tokens_per_s * to_trained,
        "simulated_tokens_per_s": sim.tokens_per_s * to_trained,
        "bottleneck": a.bottleneck,
        "decode_batch": a.decode_batch,
        "mean_staleness": a.mean_staleness,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--median", type=float, default=12)
    p.add_argument("--p99", type=float, default=96)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--eta", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--keep", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or tmp
        os.makedirs(root, exist_ok=True)
        decode_path = os.path.join(root, "decode.json")
        _decode_times(args, decode_path)
        decode = json.load(open(decode_path))
        core = sorted(os.sched_getaffinity(0))[:1]
        roles = json.load(open(role_bench(args, root, core, "roles_one_core")))
        workdir = os.path.join(root, "run")
        flags = config_flags(args, workdir, "async")
        flags += ["--config.mesh.trainer_processes=(0,)", "--config.mesh.sampler_processes=(1,)"]
        cmd = [
            sys.executable,
            os.path.join(REPO, "launch", "local_cluster.py"),
            "--num-processes",
            "2",
            "--pin-cores",
        ]
        env = dict(os.environ, PYTHONPATH=REPO)
        with open(os.path.join(root, "run.log"), "w") as log:
            subprocess.run([*cmd, "--", *flags], env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        measured = json.load(open(os.path.join(workdir, "summary.json")))
    out = {
        "workload": vars(args),
        "decode_step_s": decode,
        "roles": roles,
        "measured": {k: measured[k] for k in KEYS},
        "predicted_busy_slots": predict(args, decode, roles, static=False),
        "predicted_all_slots": predict(args, decode, roles, static=True),
    }  # fmt: skip
    print(json.dumps(out, indent=2))
    m = out["measured"]["steady_train_tokens_per_s"]
    print("\n| decode step cost | model tok/s | simulator tok/s | measured | model error |")
    print("|---|---|---|---|---|")
    for key, name in (("predicted_busy_slots", "t(busy slots)"), ("predicted_all_slots", "t(all slots)")):
        r = out[key]
        print(f"| {name} | {r['model_tokens_per_s']:.0f} | {r['simulated_tokens_per_s']:.0f} | {m:.0f} | "
              f"{r['model_tokens_per_s'] / m - 1:+.1%} |")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
