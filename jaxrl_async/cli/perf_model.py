"""Choose the sampler/trainer device split before paying for it.

Sweeps every split with the analytic model, prunes splits over the staleness bound η or with unbalanced
rates, reports the best one and its speedup over sync RL, and optionally checks both with the
discrete-event simulator. Writes report.json and PNG plots to --out.

  jaxrl-perf --scenario configs/scenarios/areal_1p5b_math.json --out /tmp/perf --simulate
  jaxrl-perf --scenario S.json --decode-bench decode.json --train-bench train.json --out D
  jaxrl-perf --hardware cpu --devices 8 --max-staleness 2 --model-json config.json \\
      --prompts 64 --samples-per-prompt 8 --prompt-len 16 --lengths lognormal:median=8,p99=24 --out D

Roles sharing one host (fake CPU devices, or `mesh.colocate`): give benchmarks/bench_roles.py files instead;
with --devices, every benched split summing to it is swept (docs/performance-model.md, "Shared host"):

  jaxrl-perf --roles-bench roles_1.json --max-staleness 2 --out D
  jaxrl-perf --roles-bench r1.json,r2.json,r3.json --devices 4 --max-staleness 2 --out D

`jaxrl-perf` runs the same program.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from jaxrl_async.cli import hf_config_file, run_command
from jaxrl_async.perf import model as perf_model
from jaxrl_async.perf.latency import load_decode_bench
from jaxrl_async.perf.report import build_report, format_table, plot_latency, plot_sweep, write_report
from jaxrl_async.perf.scenario import scenario_from_dict
from jaxrl_async.perf.shared_host import load_role_bench, predict_async, predict_sync, sweep_shared
from jaxrl_async.perf.simulator import simulate
from jaxrl_async.perf.system import build_system, load_train_bench
from jaxrl_async.perf.weight_sync import sync_report

_SCENARIO = flags.DEFINE_string("scenario", None, "scenario JSON (configs/scenarios/)")
_HARDWARE = flags.DEFINE_string(
    "hardware", None, "preset (tpu-v5e, tpu-v5p, tpu-v6e, h100, h800, h200) or 'cpu' to measure"
)
_DEVICES = flags.DEFINE_integer("devices", None, "total devices to split")
_MAX_STALENESS = flags.DEFINE_integer("max-staleness", None, "maximum staleness η")
_MODEL_JSON = flags.DEFINE_string(
    "model-json", None, "ModelShape JSON, or a Hugging Face config.json or the directory holding it"
)
_PROMPTS = flags.DEFINE_integer("prompts", None, "prompts per train batch (B)")
_SAMPLES = flags.DEFINE_integer("samples-per-prompt", None, "samples per prompt (G)")
_PROMPT_LEN = flags.DEFINE_integer("prompt-len", None, "prompt tokens")
_LENGTHS = flags.DEFINE_string(
    "lengths", None, "kind:k=v,... | JSON file (list or distribution) | tb:LOGDIR:TAG"
)
_DECODE_BENCH = flags.DEFINE_string(
    "decode-bench", None, "benchmarks/bench_decode.py JSON: {devices, context_len, points}"
)
_TRAIN_BENCH = flags.DEFINE_string(
    "train-bench", None, "benchmarks/bench_train.py JSON: {devices, train_tokens_per_s}"
)
_TRAIN_MFU = flags.DEFINE_float("train-mfu", None, "trainer model FLOPs utilisation")
_BALANCE_TOL = flags.DEFINE_float("balance-tol", None, "allowed sampler/trainer rate imbalance")
_STATIC_BATCH = flags.DEFINE_bool(
    "static-batch", False, "each decode step costs all slots (a static-shape engine)"
)
_PRUNE_ON = flags.DEFINE_enum("prune-on", "max", ["max", "mean"], "staleness compared with η")
_SIMULATE = flags.DEFINE_bool("simulate", False, "check the best split and sync with the simulator")
_SIM_STEPS = flags.DEFINE_integer("sim-steps", 30, "simulated train steps")
_OUT = flags.DEFINE_string("out", None, "output directory")
_ROLES_BENCH = flags.DEFINE_list(
    "roles-bench", None, "comma-separated benchmarks/bench_roles.py JSON files: the shared-host model"
)
flags.mark_flags_as_required(["out"])


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


def scenario_dict() -> dict:
    """The scenario file (if any) with command-line overrides applied."""
    d: dict = {}
    if _SCENARIO.value:
        with open(_SCENARIO.value) as f:
            d = json.load(f)
    if _HARDWARE.value:
        d["hardware"] = _HARDWARE.value
    if _DEVICES.value:
        d["total_devices"] = _DEVICES.value
    if _MAX_STALENESS.value is not None:
        d["max_staleness"] = _MAX_STALENESS.value
    if _MODEL_JSON.value:
        path = hf_config_file(_MODEL_JSON.value, "--model-json")
        with open(path) as f:
            m = json.load(f)
        d["model"] = {"hf_config": path} if "num_hidden_layers" in m else m
    wl = d.setdefault("workload", {})
    for key, val in (
        ("prompts_per_batch", _PROMPTS.value),
        ("samples_per_prompt", _SAMPLES.value),
        ("prompt_len", _PROMPT_LEN.value),
    ):
        if val is not None:
            wl[key] = val
    if _LENGTHS.value:
        wl["lengths"] = parse_lengths(_LENGTHS.value)
    opts = d.setdefault("options", {})
    if _TRAIN_MFU.value is not None:
        opts["train_mfu"] = _TRAIN_MFU.value
    if _STATIC_BATCH.value:
        opts["static_batch"] = True
    if _BALANCE_TOL.value is not None:
        d["balance_tol"] = _BALANCE_TOL.value
    missing = [k for k in ("hardware", "total_devices", "max_staleness", "model") if k not in d]
    if missing:
        raise app.UsageError(f"missing {missing}: give --scenario or the flags")
    return d


def shared_host_report() -> dict:
    """Predictions from role benches (roles share the host's cores); writes report.json and sweep.png."""
    benches = [load_role_bench(p) for p in _ROLES_BENCH.value]
    if _MAX_STALENESS.value is None:
        raise app.UsageError("--roles-bench needs --max-staleness")
    first = benches[0]
    sync = predict_sync(first, first)
    if _DEVICES.value:
        sweep = sweep_shared(benches, _DEVICES.value, _MAX_STALENESS.value)
    else:
        sweep = [predict_async(first, first, _MAX_STALENESS.value)]
    best = max(sweep, key=lambda r: r.tokens_per_s)
    print(f"shared host: {first.cores} cores, η = {_MAX_STALENESS.value}; trained tokens/s per split")
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
        "role_benches": list(_ROLES_BENCH.value),
    }
    write_report(_OUT.value, report)
    plot_sweep(os.path.join(_OUT.value, "sweep.png"), sweep, sync, _MAX_STALENESS.value,
               ylabel="trained tokens / s",
               best=best)  # fmt: skip
    print(
        f"best: {best.sampler_devices} sampler + {best.trainer_devices} trainer devices, "
        f"{best.tokens_per_s:.4g} tok/s, {report['speedup']:.2f}x sync of the first bench "
        f"({sync.tokens_per_s:.4g} tok/s), staleness mean {best.mean_staleness:.2f} "
        f"max {best.max_staleness:.2f}"
    )
    print(f"wrote {_OUT.value}/report.json, sweep.png")
    return report


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]} (several --roles-bench files: a,b,c)")
    if _ROLES_BENCH.value:
        shared_host_report()
    else:
        split_report()


def split_report() -> dict:
    """The device-split sweep of a scenario; writes report.json, sweep.png and latency.png."""
    sc = scenario_from_dict(scenario_dict())
    hw = sc.hardware
    bench = load_decode_bench(_DECODE_BENCH.value) if _DECODE_BENCH.value else None
    train_bench = load_train_bench(_TRAIN_BENCH.value) if _TRAIN_BENCH.value else None
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
    results = perf_model.sweep(system, sc.balance_tol, _PRUNE_ON.value)
    sync = perf_model.analyze_sync(system)
    best = perf_model.best_split(results)
    note = ""
    if best is None:
        best = perf_model.best_split(results, ignore_balance=True)
        note = "no split passes every filter; best within η that fits, ignoring balance" if best else ""
    print(f"scenario: {sc.name}  ({hw.name} x {sc.total_devices}, η = {sc.max_staleness})")
    print(format_table(results, sync))
    sims = {}
    if _SIMULATE.value:
        sims["sync"] = simulate(system, 0, 0, sync=True, steps=_SIM_STEPS.value)
        if best:
            split = (best.sampler_devices, best.trainer_devices)
            sims["best"] = simulate(system, *split, steps=_SIM_STEPS.value)
    extra = {
        "scenario": sc.name,
        "note": note,
        "hardware": hw.__dict__,
        "published": sc.raw.get("published"),
        "sources": sc.raw.get("sources"),
    }
    if best:
        extra["weight_sync_s"] = {
            "link": system.sync_link.name if system.sync_link else None,
            "charged_s": best.sync_s,
            "by_link": sync_report(system.sync_weight_bytes, best.trainer_devices, best.sampler_devices,
                                   best.replicas),  # fmt: skip
        }
    report = build_report(system, results, sync, best, sims, extra)
    write_report(_OUT.value, report)
    plot_sweep(os.path.join(_OUT.value, "sweep.png"), results, sync, sc.max_staleness, best=best)
    plot_latency(
        os.path.join(_OUT.value, "latency.png"), system.sampler.latency, bench, system.sampler.max_batch
    )
    if note:
        print(note)
    if best:
        print(
            f"best: {best.sampler_devices} sampler + {best.trainer_devices} trainer devices, "
            f"{best.tokens_per_s:.4g} tok/s, {report['speedup']:.2f}x sync ({sync.tokens_per_s:.4g} tok/s), "
            f"max staleness {best.max_staleness:.2f}, mean {best.mean_staleness:.2f}"
        )
        ws = extra["weight_sync_s"]
        print(
            f"weight sync per version ({system.sync_weight_bytes / 1e9:.3g} GB x {best.replicas} replicas, "
            f"{best.trainer_devices} -> {best.sampler_devices} devices): charged {ws['charged_s']:.3g} s "
            f"over {ws['link']}; " + ", ".join(f"{k} {v:.3g} s" for k, v in ws["by_link"].items())
        )
    else:
        print("no split is within η and fits in memory (see the table)")
    for k, v in sims.items():
        print(
            f"simulated {k}: {v.tokens_per_s:.4g} tok/s, staleness {v.mean_staleness:.2f} / {v.max_staleness}"
        )
    print(f"wrote {_OUT.value}/report.json, sweep.png, latency.png")
    return report


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m jaxrl_async.cli.perf_model`, as the tests start it
    run()
