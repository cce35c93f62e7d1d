"""Performance model: roofline fit, length distributions, analytic model vs discrete-event simulator, CLI."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrl_async.model.config import ModelConfig
from jaxrl_async.perf import model as pm
from jaxrl_async.perf.hardware import PRESETS, measure_this_cpu
from jaxrl_async.perf.latency import DecodeLatency, fit_decode_latency, latency_from_hardware
from jaxrl_async.perf.shapes import ModelShape, shape_from_model_config
from jaxrl_async.perf.simulator import simulate
from jaxrl_async.perf.system import Sampler, System, Trainer, build_system
from jaxrl_async.perf.workload import (
    EmpiricalLengths,
    LogNormalLengths,
    MixtureLengths,
    UniformLengths,
    Workload,
    lengths_from_tensorboard,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LATENCY = DecodeLatency(overhead_s=0.002, weights_s=0.010, kv_s_per_seq=5e-5, compute_s_per_seq=2e-4)
LOGNORMAL = LogNormalLengths(200, 1000, max_len=2000)
TAIL = MixtureLengths((0.99, 0.01), (LogNormalLengths(150, 300), UniformLengths(300, 900)))


def toy_system(
    max_staleness, lengths=LOGNORMAL, prompts=16, group=4, slots=64, tps=4000.0, update_s=0.0, prefill_s=0.0
):
    wl = Workload(prompts, group, 64, lengths)
    return System(8, Sampler(LATENCY, 1, slots, prefill_s, update_s), Trainer(tps, 1, 0.0), wl, max_staleness)


def test_roofline_fit_recovers_curve_from_noisy_points():
    rng = np.random.default_rng(0)
    b = np.array([1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512])
    t = LATENCY.step_s(b) * (1 + 0.02 * rng.standard_normal(len(b)))
    fit = fit_decode_latency(b, t)
    grid = np.geomspace(1, 512, 50)
    np.testing.assert_allclose(fit.step_s(grid), LATENCY.step_s(grid), rtol=0.05)
    assert fit.knee == pytest.approx(LATENCY.knee, rel=0.3)
    # A purely memory-bound curve (no compute region in range) is fitted too.
    flat = fit_decode_latency([1, 4, 16], [0.010, 0.0101, 0.0104])
    assert flat.step_s(8) == pytest.approx(0.01017, rel=0.01)


def test_latency_from_hardware_is_a_roofline():
    shape = ModelShape(params=1e9, n_layers=16, d_model=2048, n_heads=16, n_kv_heads=4, head_dim=128)
    lat = latency_from_hardware(
        PRESETS["h100"], shape, context=1000, mem_efficiency=1.0, compute_efficiency=1.0
    )
    assert lat.step_s(1) == pytest.approx((2e9 + shape.kv_bytes_per_token * 1000) / 3.35e12, rel=1e-6)
    # At 1000 tokens of context GQA KV streaming outgrows compute: memory-bound at any batch.
    assert lat.knee == float("inf")
    short = latency_from_hardware(
        PRESETS["h100"], shape, context=10, mem_efficiency=1.0, compute_efficiency=1.0
    )
    big = 1e5
    assert short.step_s(big) == pytest.approx(big * shape.decode_flops_per_token(10) / 989e12, rel=1e-6)


def test_length_distributions():
    d = LogNormalLengths(800, 4000)
    assert d.quantile(np.array([0.5, 0.99])) == pytest.approx([800, 4000], rel=1e-6)
    rng = np.random.default_rng(1)
    x = d.sample(rng, 200_000)
    assert x.mean() == pytest.approx(d.mean(), rel=0.02)
    batches = TAIL.sample(rng, 64 * 5000).reshape(5000, 64)
    assert batches.max(1).mean() == pytest.approx(TAIL.expected_max(64), rel=0.04)
    assert batches.mean() == pytest.approx(TAIL.mean(), rel=0.01)
    rep = TAIL.representative(64)
    assert rep[-1] == pytest.approx(TAIL.expected_max(64), rel=0.01) and np.all(np.diff(rep) >= 0)
    capped = LogNormalLengths(8000, 40000, max_len=27648)
    assert capped.sample(rng, 10_000).max() == 27648
    emp = EmpiricalLengths((10.0, 20.0, 30.0))
    assert set(emp.sample(rng, 100)) <= {10, 20, 30} and emp.mean() == pytest.approx(20, abs=0.01)
    # Memoized by value: an equal distribution gets the same figures, a caller's copy is its own, and a
    # different one gets its own figures.
    top = LogNormalLengths(800, 4000).top_order_stats(64, 4)
    top[:] = 0.0
    again = d.top_order_stats(64, 4)
    assert np.all(again > 0) and np.all(np.diff(again) < 0) and len(again) == 4
    assert LogNormalLengths(800, 4001).top_order_stats(64, 4)[0] > again[0]
    assert LogNormalLengths(800, 4000).mean() == d.mean()


def test_shape_from_model_config_counts_llama_params():
    # Llama-3.2-1B: 1,235,814,400 parameters (tied embeddings).
    cfg = ModelConfig(
        vocab_size=128256,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        ffw_size=8192,
        tie_embeddings=True,
    )
    shape = shape_from_model_config(cfg)
    assert shape.params == 1_235_814_400
    assert shape.kv_bytes_per_token == 2 * 16 * 8 * 64 * 2


def test_build_system_caps_decode_batch_by_kv_memory():
    shape = ModelShape(params=1e9, n_layers=10, d_model=1024, n_heads=8, n_kv_heads=2, head_dim=128)
    wl = Workload(8, 4, 100, UniformLengths(100, 900))
    hw = PRESETS["tpu-v5e"]
    system = build_system(hw, shape, wl, 8, 2, mem_reserve_frac=0.0)
    per_seq = shape.kv_bytes_per_token * (100 + 900)
    assert system.sampler.max_batch == int((16e9 - 2e9) // per_seq)
    assert system.sampler.devices_per_replica == 1
    mean = build_system(hw, shape, wl, 8, 2, mem_reserve_frac=0.0, kv_reserve="mean")
    assert mean.sampler.max_batch > system.sampler.max_batch
    # The sampler's paged rule: resident P + E[L^2] / (2 E[L]) (uniform 100..900: 100 + 541.7), full prompt
    # pages shared by the 4 samples of a prompt (96 of 100 tokens), a call of growth, half a page.
    paged = build_system(hw, shape, wl, 8, 2, mem_reserve_frac=0.0, kv_reserve="paged", page_size=16)
    lens = wl.lengths.representative(4000).astype(float)
    per_seq = 96 / 4 + 4 + np.mean(lens**2) / (2 * np.mean(lens)) + 8 + 8
    assert paged.sampler.max_batch == int((16e9 - 2e9) // (shape.kv_bytes_per_token * per_seq))
    assert system.sampler.max_batch < paged.sampler.max_batch
    with pytest.raises(ValueError, match="kv_reserve must be"):
        build_system(hw, shape, wl, 8, 2, kv_reserve="paged_kv")


# Regimes covered: η = 0 (sync on the split), window-limited (η = 1, 2), trainer-bound, sampler-bound,
# a 1% long tail, and weight-update / prefill stalls.
GRID = [
    dict(max_staleness=0, s=4),
    dict(max_staleness=1, s=2),
    dict(max_staleness=1, s=4, tps=8000.0),
    dict(max_staleness=2, s=4),
    dict(max_staleness=2, s=6, tps=8000.0),
    dict(max_staleness=4, s=2),
    dict(max_staleness=4, s=6),
    dict(max_staleness=4, s=4, tps=8000.0),
    dict(max_staleness=0, s=4, lengths=TAIL),
    dict(max_staleness=2, s=2, lengths=TAIL),
    dict(max_staleness=4, s=4, lengths=TAIL, tps=8000.0),
    dict(max_staleness=8, s=2, lengths=TAIL, tps=8000.0, prompts=64),
    dict(max_staleness=2, s=4, update_s=0.05, prefill_s=0.002),
    dict(max_staleness=3, s=6, prompts=64, group=8, slots=128, tps=16000.0),
]


@pytest.mark.parametrize("case", GRID, ids=[str(c) for c in GRID])
def test_simulator_agrees_with_analytic_model(case):
    case = dict(case)
    s = case.pop("s")
    system = toy_system(**case)
    ana = pm.analyze_split(system, s, 8 - s)
    sim = simulate(system, s, 8 - s, steps=120, warmup=10, seed=0)
    assert ana.tokens_per_s == pytest.approx(sim.tokens_per_s, rel=0.10)
    # Closed-form mean staleness vs measured (in versions).
    assert ana.mean_staleness == pytest.approx(sim.mean_staleness, abs=max(0.6, 0.15 * sim.mean_staleness))
    assert sim.max_staleness >= round(sim.mean_staleness)
    if system.max_staleness == 0:
        assert sim.max_staleness == 0 and sim.mean_token_staleness == 0


@pytest.mark.parametrize("lengths", [LOGNORMAL, TAIL], ids=["lognormal", "tail"])
def test_sync_baseline_agrees_with_simulator(lengths):
    system = toy_system(0, lengths=lengths)
    ana = pm.analyze_sync(system)
    sim = simulate(system, 0, 0, sync=True, steps=200, seed=0)
    assert ana.tokens_per_s == pytest.approx(sim.tokens_per_s, rel=0.10)
    assert sim.max_staleness == 0


def test_static_batch_engine_pays_full_steps_in_the_window_bound_regime():
    # 16 devices, η = 2, lognormal p99/median = 8, a fast trainer: the staleness window binds and few
    # slots are busy. An engine with static shapes pays t(all slots) for every decode step anyway.
    wl = Workload(16, 4, 64, LogNormalLengths(200, 1600, max_len=3200))
    paged = System(16, Sampler(LATENCY, 1, 64), Trainer(8000.0, 1, 0.0), wl, 2)
    static = dataclasses.replace(paged, sampler=dataclasses.replace(paged.sampler, static_batch=True))
    a_paged, a_static = pm.analyze_split(paged, 12, 4), pm.analyze_split(static, 12, 4)
    assert a_paged.bottleneck == a_static.bottleneck == "staleness"
    assert a_paged.decode_batch < 0.25 * 64
    sim = simulate(static, 12, 4, steps=150, warmup=20, seed=0)
    assert a_static.tokens_per_s == pytest.approx(sim.tokens_per_s, rel=0.05)
    assert 0.7 < a_static.tokens_per_s / a_paged.tokens_per_s < 0.9
    # With every slot busy (two sampler replicas for a large batch: sampler-bound) they cost the same.
    full = dataclasses.replace(
        paged, workload=dataclasses.replace(wl, prompts_per_batch=128), max_staleness=8
    )
    full_static = dataclasses.replace(full, sampler=static.sampler)
    r, r_static = pm.analyze_split(full, 2, 14), pm.analyze_split(full_static, 2, 14)
    assert r.bottleneck == "sampler" and r.decode_batch == pytest.approx(64, rel=0.02)
    assert r.tokens_per_s == pytest.approx(r_static.tokens_per_s, rel=0.02)


def test_admission_lag_lowers_the_window_bound_rate_alike_in_model_and_simulator():
    # The window-bound system above with the engine's admission lag: the window's critical path grows by
    # the lag, and the model and the simulator still agree. A trainer-bound system does not notice it.
    wl = Workload(16, 4, 64, LogNormalLengths(200, 1600, max_len=3200))
    static = System(16, Sampler(LATENCY, 1, 64, static_batch=True), Trainer(8000.0, 1, 0.0), wl, 2)
    step_s = static.sampler.step_s(64)
    lagged = dataclasses.replace(static, sampler=dataclasses.replace(static.sampler, admit_lag_s=50 * step_s))
    a, a_lag = pm.analyze_split(static, 12, 4), pm.analyze_split(lagged, 12, 4)
    assert a.bottleneck == a_lag.bottleneck == "staleness"
    assert a_lag.tokens_per_s < 0.95 * a.tokens_per_s
    sim = simulate(lagged, 12, 4, steps=150, warmup=20, seed=0)
    assert a_lag.tokens_per_s == pytest.approx(sim.tokens_per_s, rel=0.08)
    slow = toy_system(3, tps=500.0)
    slow_lag = dataclasses.replace(slow, sampler=dataclasses.replace(slow.sampler, admit_lag_s=0.05))
    assert pm.analyze_split(slow_lag, 6, 2).tokens_per_s == pytest.approx(
        pm.analyze_split(slow, 6, 2).tokens_per_s
    )
    with pytest.raises(ValueError, match="admit_lag_s"):
        dataclasses.replace(static.sampler, admit_lag_s=-1.0)


def test_admission_rule_pins_staleness_when_trainer_bound():
    # A slow trainer: the sampler runs η versions ahead and waits; samples are trained η versions old.
    system = toy_system(3, tps=500.0)
    r = pm.analyze_split(system, 6, 2)
    assert r.bottleneck == "trainer"
    sim = simulate(system, 6, 2, steps=40, seed=1)
    assert sim.mean_staleness == pytest.approx(3.0, abs=0.1)
    assert sim.trainer_busy == pytest.approx(1.0, abs=0.02)


def test_sweep_picks_a_feasible_split_and_beats_sync_on_a_long_tail():
    system = toy_system(8, lengths=TAIL, tps=8000.0)
    results = pm.sweep(system, balance_tol=0.6)
    assert [r.sampler_devices for r in results] == list(range(1, 8))
    best = pm.best_split(results)
    assert best is not None and best.feasible
    assert all(r.tokens_per_s <= best.tokens_per_s for r in results if r.feasible)
    assert best.max_staleness <= 8
    assert best.tokens_per_s > 1.5 * pm.analyze_sync(system).tokens_per_s
    # A 1% tail 3-6x longer than the body makes the longest sample several versions old: with η = 4 no
    # split passes on the max, while the mean (pinned at η by admission) passes.
    tight = dataclasses.replace(system, max_staleness=4)
    assert pm.best_split(pm.sweep(tight, balance_tol=0.6)) is None
    assert pm.best_split(pm.sweep(tight, balance_tol=0.6, staleness_metric="mean")) is not None
    on_policy = pm.sweep(dataclasses.replace(system, max_staleness=0))
    assert all(r.mean_staleness == 0 for r in on_policy)


def test_measure_this_cpu_is_plausible():
    hw = measure_this_cpu(seconds=0.4)
    assert 1e8 < hw.peak_flops < 1e14 and 1e8 < hw.mem_bw < 1e13 and hw.mem_bytes > 1e9


def test_lengths_from_tensorboard(tmp_path):
    from tensorboardX import SummaryWriter

    w = SummaryWriter(str(tmp_path))
    values = np.random.default_rng(0).integers(10, 500, size=400)
    w.add_histogram("rollout/response_len", values, global_step=0)
    for i, v in enumerate([5.0, 7.0, 9.0]):
        w.add_scalar("rollout/mean_len", v, i)
    w.close()
    hist = lengths_from_tensorboard(str(tmp_path), "rollout/response_len")
    assert len(hist) == 400 and np.mean(hist) == pytest.approx(values.mean(), rel=0.05)
    assert lengths_from_tensorboard(str(tmp_path), "rollout/mean_len") == [5.0, 7.0, 9.0]
    with pytest.raises(ValueError, match="not found"):
        lengths_from_tensorboard(str(tmp_path), "nope")


def test_cli_writes_report_and_plots(tmp_path):
    model = {"params": 1e9, "n_layers": 16, "d_model": 2048, "n_heads": 16, "n_kv_heads": 4, "head_dim": 128}
    lengths = {"kind": "lognormal", "median": 500, "p99": 3000, "max_len": 4096}
    scenario = {
        "name": "toy",
        "hardware": "h100",
        "total_devices": 8,
        "max_staleness": 6,
        "model": model,
        "workload": {"prompts_per_batch": 32, "samples_per_prompt": 8, "prompt_len": 128, "lengths": lengths},
        "options": {"max_decode_batch": 128},
    }
    points = [{"batch": b, "step_s": float(LATENCY.step_s(b))} for b in (1, 8, 32, 64, 128, 256)]
    decode = {"devices": 1, "context_len": 1000, "points": points}
    train = {"devices": 4, "train_tokens_per_s": 40000.0}
    paths = {}
    for name, obj in (("scenario", scenario), ("decode", decode), ("train", train)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(obj))
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "jaxrl_async.cli.perf_model",
        "--scenario",
        str(paths["scenario"]),
        "--decode-bench",
        str(paths["decode"]),
        "--train-bench",
        str(paths["train"]),
        "--out",
        str(out),
        "--simulate",
        "--sim-steps",
        "10",
    ]
    env = dict(os.environ, PYTHONPATH=ROOT)  # the package of this checkout
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "best:" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    best = report["best"]
    assert best["sampler_devices"] + best["trainer_devices"] == 8
    for key in ("tokens_per_s", "max_staleness", "mean_staleness"):
        assert best[key] is not None
    assert report["speedup"] == pytest.approx(best["tokens_per_s"] / report["sync"]["tokens_per_s"])
    assert len(report["sweep"]) == 7
    # The fitted curve came from the bench file and the trainer speed from the train bench.
    assert report["system"]["trainer"]["tokens_per_s_per_device"] == 10000.0
    assert report["system"]["sampler"]["latency"]["weights_s"] == pytest.approx(LATENCY.weights_s, rel=0.05)
    assert report["simulated"]["best"]["tokens_per_s"] > 0
    for png in ("sweep.png", "latency.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("name", ["qwen30b_long_tail", "areal_1p5b_math", "areal_7b_math"])
def test_scenario_files_load_and_sweep(name):
    from jaxrl_async.perf.scenario import load_scenario

    sc = load_scenario(os.path.join(ROOT, "configs", "scenarios", f"{name}.json"))
    system = build_system(
        sc.hardware, sc.shape, sc.workload, sc.total_devices, sc.max_staleness, **sc.options
    )
    results = pm.sweep(system, sc.balance_tol)
    best = pm.best_split(results) or pm.best_split(results, ignore_balance=True)
    assert best is not None
    assert best.tokens_per_s > pm.analyze_sync(system).tokens_per_s


def test_sweep_plot_marks_the_chosen_split_and_the_sync_value(tmp_path):
    from types import SimpleNamespace

    from jaxrl_async.perf.report import plot_sweep

    rows = [SimpleNamespace(sampler_devices=k, trainer_devices=8 - k, tokens_per_s=100.0 * k * (8 - k),
                            feasible=True, max_staleness=1.0, mean_staleness=0.5)
            for k in range(1, 8)]  # fmt: skip
    sync = SimpleNamespace(tokens_per_s=800.0)
    labels = plot_sweep(str(tmp_path / "s.png"), rows, sync, 2, best=rows[3])
    assert "sync, all devices: 800" in labels
    assert "chosen: 4 sampler / 4 trainer, 1600 (2.00x sync)" in labels
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_a_lora_step_costs_its_frozen_base_no_weight_gradients():
    """Full fine-tuning: forward + twice the forward back. LoRA: the base's matmuls once more back (no
    weight gradients), attention twice, and 6 FLOPs an adapter parameter: about 2/3 of full when matmuls
    dominate; an extra forward (the proximal pass) costs one forward either way."""
    from jaxrl_async.model import presets
    from jaxrl_async.model.lora import LoraConfig
    from jaxrl_async.perf.shapes import shape_from_model_config

    cfg = presets.get("qwen3-8b")
    full = shape_from_model_config(cfg)
    lora = shape_from_model_config(cfg, lora=LoraConfig(enabled=True, rank=16))
    assert lora.trainable_params < 0.01 * lora.params
    for seq in (1.0, 8192.0, 32768.0):
        f, lo = full.train_flops_per_token(seq), lora.train_flops_per_token(seq)
        fwd = full.decode_flops_per_token(seq / 2.0)
        assert f == pytest.approx(3 * fwd)
        attn = full.attn_flops_per_token(seq / 2.0)
        assert lo == pytest.approx(fwd + 2.0 * full.n_active + 2 * attn + 6 * lora.trainable_params)
    assert 0.66 < lora.train_flops_per_token(1.0) / full.train_flops_per_token(1.0) < 0.68
    assert lora.train_flops_per_token(32768.0, 1) - lora.train_flops_per_token(32768.0) == pytest.approx(
        full.decode_flops_per_token(16384.0))
