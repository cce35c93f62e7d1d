"""Choose the sampler/trainer device split before paying for it.

Sweeps every split with the analytic model, prunes splits over the staleness bound η or with unbalanced
rates, reports the best one and its speedup over sync RL, and optionally checks both with the
discrete-event simulator. Writes report.json and PNG plots to --out.

  python tools/perf_model.py --scenario tools/scenarios/areal_1p5b_math.json --out /tmp/perf --simulate
  python tools/perf_model.py --scenario S.json --decode-bench decode.json --train-bench train.json --out D
  python tools/perf_model.py --hardware cpu --devices 8 --eta 2 --model-json config.json \\
      --prompts 64 --samples-per-prompt 8 --prompt-len 16 --lengths lognormal:median=8,p99=24 --out D

Roles sharing one host (fake CPU devices, or `mesh.colocate`): give tools/bench_roles.py files instead;
with --devices, every benched split summing to it is swept (docs/performance-model.md, "Shared host"):

  python tools/perf_model.py --roles-bench roles_1.json --eta 2 --out D
  python tools/perf_model.py --roles-bench r1.json r2.json r3.json --devices 4 --eta 2 --out D
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl_async.perf import model as perf_model  # noqa: E402
from jaxrl_async.perf.latency import load_decode_bench  # noqa: E402
from jaxrl_async.perf.report import build_report, format_table, plot_latency, plot_sweep, write_report  # noqa: E402
from jaxrl_async.perf.scenario import scenario_from_dict  # noqa: E402
from jaxrl_async.perf.shared_host import load_role_bench, predict_async, predict_sync, sweep_shared  # noqa: E402
from jaxrl_async.perf.simulator import simulate  # noqa: E402
from jaxrl_async.perf.system import build_system, load_train_bench  # noqa: E402


def parse_lengths(spec: str) -> dict:
    """Length spec: "lognormal:median=800,p99=2000,max_len=4096", "uniform:low=..,high=..", a JSON file
    (a list of lengths or a distribution dict) or "tb:LOGDIR:TAG"."""
    if spec.startswith("tb:"):
        logdir, tag = spec[3:].rsplit(":", 1)
        return {"kind": "tensorboard", "logdir": logdir, "tag": tag}
    if os.path.exists(spec):
        with open(spec) as f:
            d = json.load(f)
        return {"kind": "empirical", "values": d} if isinstance(d, list) else d
    kind, _, rest = spec.partition(":")
    args = {k: float(v) for k, v in (kv.split("=") for kv in rest.split(",") if kv)}
    return {"kind": kind, **args}


def scenario_dict(args: argparse.Namespace) -> dict:
    """The scenario file (if any) with command-line overrides applied."""
    d: dict = {}
    if args.scenario:
        with open(args.scenario) as f:
            d = json.load(f)
    if args.hardware:
        d["hardware"] = args.hardware
    if args.devices:
        d["total_devices"] = args.devices
    if args.eta is not None:
        d["max_staleness"] = args.eta
    if args.model_json:
        with open(args.model_json) as f:
            m = json.load(f)
        d["model"] = {"hf_config": args.model_json} if "num_hidden_layers" in m else m
    wl = d.setdefault("workload", {})
    for key, val in (
        ("prompts_per_batch", args.prompts),
        ("samples_per_prompt", args.samples_per_prompt),
        ("prompt_len", args.prompt_len),
    ):
        if val is not None:
            wl[key] = val
    if args.lengths:
        wl["lengths"] = parse_lengths(args.lengths)
    opts = d.setdefault("options", {})
    if args.train_mfu is not None:
        opts["train_mfu"] = args.train_mfu
    if args.static_batch:
        opts["static_batch"] = True
    if args.balance_tol is not None:
        d["balance_tol"] = args.balance_tol
    missing = [k for k in ("hardware", "total_devices", "max_staleness", "model") if k not in d]
    if missing:
        raise SystemExit(f"missing {missing}: give --scenario or the flags")
    return d


def shared_host_main(args: argparse.Namespace) -> dict:
    """Predictions from role benches (roles share the host's cores); writes report.json and sweep.png."""
    benches = [load_role_bench(p) for p in args.roles_bench]
    if args.eta is None:
        raise SystemExit("--roles-bench needs --eta")
    first = benches[0]
    sync = predict_sync(first, first)
    if args.devices:
        sweep = sweep_shared(benches, args.devices, args.eta)
    else:
        sweep = [predict_async(first, first, args.eta)]
    best = max(sweep, key=lambda r: r.tokens_per_s)
    print(f"shared host: {first.cores} cores, η = {args.eta}; trained tokens/s per split")
    print(f"{'sampler':>8} {'trainer':>8} {'tok/s':>9} {'period s':>9} {'bound':>8} {'stale mean':>10}")
    for r in [sync, *sweep]:
        print(
            f"{r.sampler_devices:>8} {r.trainer_devices:>8} {r.tokens_per_s:>9.1f} {r.period_s:>9.3f} "
            f"{r.bottleneck:>8} {r.mean_staleness:>10.2f}"
        )
    report = {
        "model": "shared_host",
        "best": best.to_dict(),
        "sync": sync.to_dict(),
        "speedup": best.tokens_per_s / sync.tokens_per_s,
        "sweep": [r.to_dict() for r in sweep],
        "role_benches": list(args.roles_bench),
    }
    write_report(args.out, report)
    plot_sweep(os.path.join(args.out, "sweep.png"), sweep, sync, args.eta, ylabel="trained tokens / s")
    print(
        f"best: {best.sampler_devices} sampler + {best.trainer_devices} trainer devices, "
        f"{best.tokens_per_s:.4g} tok/s, {report['speedup']:.2f}x sync of the first bench "
        f"({sync.tokens_per_s:.4g} tok/s), staleness mean {best.mean_staleness:.2f} "
        f"max {best.max_staleness:.2f}"
    )
    print(f"wrote {args.out}/report.json, sweep.png")
    return report


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", help="scenario JSON (tools/scenarios/)")
    p.add_argument(
        "--hardware", help="preset (tpu-v5e, tpu-v5p, tpu-v6e, h100, h800, h200) or 'cpu' to measure"
    )
    p.add_argument("--devices", type=int, help="total devices to split")
    p.add_argument("--eta", type=int, help="maximum staleness η")
    p.add_argument("--model-json", help="ModelShape JSON or a Hugging Face config.json")
    p.add_argument("--prompts", type=int, help="prompts per train batch (B)")
    p.add_argument("--samples-per-prompt", type=int, help="samples per prompt (G)")
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--lengths", help="kind:k=v,... | JSON file (list or distribution) | tb:LOGDIR:TAG")
    p.add_argument("--decode-bench", help="tools/bench_decode.py JSON: {devices, context_len, points}")
    p.add_argument("--train-bench", help="tools/bench_train.py JSON: {devices, train_tokens_per_s}")
    p.add_argument("--train-mfu", type=float)
    p.add_argument("--balance-tol", type=float)
    p.add_argument(
        "--static-batch", action="store_true", help="each decode step costs all slots (a static-shape engine)"
    )
    p.add_argument("--prune-on", choices=("max", "mean"), default="max", help="staleness compared with η")
    p.add_argument("--simulate", action="store_true", help="check the best split and sync with the simulator")
    p.add_argument("--sim-steps", type=int, default=30)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--roles-bench", nargs="+", help="tools/bench_roles.py JSON file(s): shared-host model")
    args = p.parse_args(argv)
    if args.roles_bench:
        return shared_host_main(args)

    sc = scenario_from_dict(scenario_dict(args))
    hw = sc.hardware
    bench = load_decode_bench(args.decode_bench) if args.decode_bench else None
    train_bench = load_train_bench(args.train_bench) if args.train_bench else None
    system = build_system(
        hw,
        sc.shape,
        sc.workload,
        sc.total_devices,
        sc.max_staleness,
        decode_bench=bench,
        train_bench=train_bench,
        **sc.options,
    )
    results = perf_model.sweep(system, sc.balance_tol, args.prune_on)
    sync = perf_model.analyze_sync(system)
    best = perf_model.best_split(results)
    note = ""
    if best is None:
        best = perf_model.best_split(results, ignore_balance=True)
        note = "no split passes every filter; best within η that fits, ignoring balance" if best else ""
    print(f"scenario: {sc.name}  ({hw.name} x {sc.total_devices}, η = {sc.max_staleness})")
    print(format_table(results, sync))
    sims = {}
    if args.simulate:
        sims["sync"] = simulate(system, 0, 0, sync=True, steps=args.sim_steps)
        if best:
            sims["best"] = simulate(system, best.sampler_devices, best.trainer_devices, steps=args.sim_steps)
    extra = {
        "scenario": sc.name,
        "note": note,
        "hardware": hw.__dict__,
        "published": sc.raw.get("published"),
        "sources": sc.raw.get("sources"),
    }
    report = build_report(system, results, sync, best, sims, extra)
    write_report(args.out, report)
    plot_sweep(os.path.join(args.out, "sweep.png"), results, sync, sc.max_staleness)
    plot_latency(
        os.path.join(args.out, "latency.png"), system.sampler.latency, bench, system.sampler.max_batch
    )
    if note:
        print(note)
    if best:
        print(
            f"best: {best.sampler_devices} sampler + {best.trainer_devices} trainer devices, "
            f"{best.tokens_per_s:.4g} tok/s, {report['speedup']:.2f}x sync ({sync.tokens_per_s:.4g} tok/s), "
            f"max staleness {best.max_staleness:.2f}, mean {best.mean_staleness:.2f}"
        )
    else:
        print("no split is within η and fits in memory (see the table)")
    for k, v in sims.items():
        print(
            f"simulated {k}: {v.tokens_per_s:.4g} tok/s, staleness {v.mean_staleness:.2f} / {v.max_staleness}"
        )
    print(f"wrote {args.out}/report.json, sweep.png, latency.png")
    return report


if __name__ == "__main__":
    main()
