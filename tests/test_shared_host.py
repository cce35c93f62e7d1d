"""Shared-host model (roles on the same cores) and the role bench that calibrates it."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from jaxrl_async.perf.shared_host import (
    RoleBench,
    load_role_bench,
    predict_async,
    predict_lent_core,
    predict_sync,
    sweep_shared,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(devices=1, w_s=0.2, c_s=0.2, w_t=0.8, c_t=0.8, cores=2, batch_s=0.25, update_s=0.0):
    return RoleBench(
        sampler_devices=devices,
        trainer_devices=devices,
        cores=cores,
        num_slots=64,
        samples_per_batch=128,
        tokens_per_batch=1000.0,
        sample_batch_s=batch_s,
        sample_batch_cpu_s=c_s,
        sample_stream_s=w_s,
        sample_stream_cpu_s=c_s,
        train_step_s=w_t,
        train_step_cpu_s=c_t,
        update_s=update_s,
    )


def test_sync_adds_both_roles():
    b = _bench(batch_s=0.3, w_t=0.7, update_s=0.05)
    p = predict_sync(b, b)
    assert p.period_s == pytest.approx(1.05)
    assert p.tokens_per_s == pytest.approx(1000 / 1.05)
    assert p.mean_staleness == 0


def test_async_without_contention_is_the_slower_role():
    # One core each (p_s = p_t = 1) on two cores: no slowdown, the trainer sets the pace, staleness = η.
    p = predict_async(
        _bench(w_s=0.2, c_s=0.2, w_t=0.8, c_t=0.8), _bench(w_s=0.2, c_s=0.2, w_t=0.8, c_t=0.8), 3
    )
    assert p.slowdown == 1.0
    assert p.period_s == pytest.approx(0.8)
    assert p.bottleneck == "trainer" and p.mean_staleness == 3 and p.max_staleness == 3


def test_async_when_each_role_fills_the_host_gains_nothing():
    # Each role alone keeps both cores busy: processor sharing halves both, async == running them in turn.
    b = _bench(w_s=0.3, c_s=0.6, w_t=0.5, c_t=1.0)
    p = predict_async(b, b, 2)
    assert p.slowdown == pytest.approx(2.0)
    assert p.period_s == pytest.approx(0.8)


def test_async_partial_contention_between_the_bounds():
    b = _bench(w_s=0.2, c_s=0.26, w_t=0.8, c_t=1.4)  # 1.3 + 1.75 cores wanted on 2
    p = predict_async(b, b, 2)
    assert 0.8 < p.period_s < 1.0
    assert p.period_s == pytest.approx(0.8 + 0.2 * ((1.3 + 1.75) / 2 - 1))
    # More cores remove the contention.
    assert predict_async(b, b, 2, cores=4).period_s == pytest.approx(0.8)


def test_lent_core_gives_the_learner_what_the_sampler_leaves_idle():
    # The learner: 0.6 s a step on one core, 0.4 on both; the sampler 0.3 s a batch on its core.
    one, every = _bench(w_s=0.3, w_t=0.6), _bench(w_s=0.3, w_t=0.4)
    p = predict_lent_core(one, one, every, 2)
    v1, v2 = 1 / 0.6, 1 / 0.4
    v = v1 + (1 - 0.3 * (1 / p.trainer_s)) * (v2 - v1)  # the fixed point: the sampler busy 0.3 / step
    assert p.trainer_s == pytest.approx(1 / v)
    assert p.trainer_s == pytest.approx((1 + 0.3 * (v2 - v1)) / v2)
    assert 0.4 < p.period_s < 0.6 and p.bottleneck == "trainer" and p.max_staleness == 2
    assert p.tokens_per_s == pytest.approx(1000 / p.period_s)
    # The bounds: a sampler that never runs lends its whole core; one that never rests lends none.
    assert predict_lent_core(_bench(w_s=1e-9, w_t=0.6), one, every, 2).period_s == pytest.approx(0.4)
    busy = predict_lent_core(_bench(w_s=0.6, w_t=0.6), one, every, 2)
    assert busy.trainer_s == pytest.approx(0.6) and busy.period_s == pytest.approx(0.6)
    # Sampler-bound: the period is the sampler's, and staleness stays under max_staleness.
    slow = predict_lent_core(_bench(w_s=0.9, w_t=0.6), one, every, 2)
    assert slow.period_s == pytest.approx(0.9) and slow.bottleneck == "sampler" and slow.mean_staleness < 2
    # A learner no faster on both cores gains nothing from the lent one.
    assert predict_lent_core(one, one, _bench(w_t=0.7), 2).trainer_s == pytest.approx(0.6)
    with pytest.raises(ValueError, match="max_staleness"):
        predict_lent_core(one, one, every, 0)


def test_sampler_paced_staleness_is_below_eta():
    b = _bench(w_s=0.9, c_s=0.9, w_t=0.3, c_t=0.3)
    p = predict_async(b, b, 4)
    assert p.bottleneck == "sampler"
    assert p.mean_staleness < 4


def test_sweep_pairs_sampler_and_trainer_counts():
    benches = [
        _bench(devices=1, w_s=0.2, c_s=0.2, w_t=1.0, c_t=1.0),
        _bench(devices=2, w_s=0.3, c_s=0.3, w_t=0.7, c_t=0.7),
        _bench(devices=3, w_s=0.5, c_s=0.5, w_t=0.6, c_t=0.6),
    ]
    sweep = sweep_shared(benches, 4, 2)
    assert [(r.sampler_devices, r.trainer_devices) for r in sweep] == [(1, 3), (2, 2), (3, 1)]
    # (1, 3): sampler from the 1-device bench, trainer from the 3-device bench.
    assert sweep[0].sampler_s == pytest.approx(0.2) and sweep[0].trainer_s == pytest.approx(0.6)
    assert sweep[2].sampler_s == pytest.approx(0.5) and sweep[2].trainer_s == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no benched split sums to 9"):
        sweep_shared(benches, 9, 2)


def test_load_names_missing_fields_and_rejects_zero(tmp_path):
    d = dataclasses.asdict(_bench())
    path = tmp_path / "b.json"
    path.write_text(json.dumps(d))
    assert load_role_bench(str(path)) == _bench()
    del d["train_step_cpu_s"]
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="train_step_cpu_s"):
        load_role_bench(str(path))
    with pytest.raises(ValueError, match="RoleBench.train_step_s"):
        _bench(w_t=0.0)


def test_cli_shared_host_sweep(tmp_path):
    paths = []
    for k, (w_s, w_t) in enumerate([(0.2, 1.0), (0.3, 0.7), (0.5, 0.9)], start=1):
        p = tmp_path / f"r{k}.json"
        p.write_text(json.dumps(dataclasses.asdict(_bench(devices=k, w_s=w_s, c_s=w_s, w_t=w_t, c_t=w_t))))
        paths.append(str(p))
    out = tmp_path / "out"
    tool = ["-m", "jaxrl_async.cli.perf_model"]
    cmd = [sys.executable, *tool, "--roles-bench", ",".join(paths), "--devices", "4", "--max-staleness", "2"]
    cmd += ["--out", str(out)]
    env = dict(os.environ, PYTHONPATH=REPO)  # the package of this checkout
    printed = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    report = json.loads((out / "report.json").read_text())
    assert "best: 2 sampler + 2 trainer devices" in printed
    assert (report["best"]["sampler_devices"], report["best"]["trainer_devices"]) == (2, 2)
    assert report["speedup"] == pytest.approx(report["best"]["tokens_per_s"] / report["sync"]["tokens_per_s"])
    assert len(report["sweep"]) == 3 and (out / "sweep.png").stat().st_size > 0


def test_calibrate_roles_times_each_role_of_a_real_run(tmp_path):
    from test_orchestrator import _small

    from jaxrl_async.runtime.build import build_local
    from jaxrl_async.runtime.calibration import calibrate_roles, calibration_config, host_cores

    cfg = _small(tmp_path, **{"mesh.sampler": (1, 1), "mesh.trainer": (1, 1)})
    proc = build_local(cfg)
    try:  # an async run's admission would time two batches at once
        with pytest.raises(ValueError, match=r"calibration_config.*config\.mode='async'"):
            calibrate_roles(proc)
    finally:
        proc.close()
    proc = build_local(calibration_config(cfg))
    try:
        d = calibrate_roles(proc, batches=2)
        assert proc.learner.core.version == 3  # one untimed (compiling) + two timed train steps
        assert proc.actor.loop.engine.version == 3  # the timed weight swaps reached the sampler
    finally:
        proc.close()
    assert d["samples_per_batch"] == cfg.prompts_per_step * cfg.samples_per_prompt == 16
    assert d["cores"] == host_cores() and d["num_slots"] == 8
    max_len = cfg.sampler.max_prompt_len + cfg.sampler.max_new_tokens
    assert 16 * 2 <= d["tokens_per_batch"] <= 16 * max_len
    assert 1 <= d["completion_length_mean"] <= cfg.sampler.max_new_tokens
    assert d["sync_batch_groups"] == cfg.prompts_per_step  # sync batches timed one at a time
    assert d["train_micro_batches"] >= 1
    assert d["train_step_s"] == pytest.approx(d["train_micro_batch_s"] * d["train_micro_batches"])
    path = tmp_path / "roles.json"
    path.write_text(json.dumps(d))
    bench = load_role_bench(str(path))  # every timing positive, or this raises
    p = predict_async(bench, bench, 1)
    assert max(p.sampler_s, p.trainer_s) <= p.period_s <= p.sampler_s + p.trainer_s + 1e-9


def test_overlap_period_between_no_slowing_and_taking_turns():
    from jaxrl_async.perf.shared_host import overlap_period

    assert overlap_period(0.3, 0.3, 0.8, 0.8) == pytest.approx(0.8)  # unslowed: the longer role
    assert overlap_period(0.3, 0.6, 0.8, 1.6) == pytest.approx(0.8 + 0.3)  # both halved: in turn
    # The sampler slowed to 0.4 s a batch, the learner to 1.0 s a step: 0.4 s side by side gets 0.4 of a
    # step done, the rest (0.6 of it) at the learner's 0.8 s alone.
    assert overlap_period(0.3, 0.4, 0.8, 1.0) == pytest.approx(0.4 + 0.8 * 0.6)
    assert overlap_period(0.8, 1.0, 0.3, 0.4) == pytest.approx(0.4 + 0.8 * 0.6)  # symmetric in the roles


def test_lent_core_with_the_shared_paces_measured_side_by_side():
    one, every = _bench(w_s=0.3, w_t=0.6, update_s=0.01), _bench(w_s=0.3, w_t=0.4)
    bound = predict_lent_core(one, one, every, 2)
    # Side by side the sampler takes 0.4 s a batch (+ its weight update) and the learner 0.7 s a step,
    # slower than on one core alone: parallel ops wait for the thread on the shared core.
    p = predict_lent_core(one, one, every, 2, shared=(0.4, 0.7))
    assert p.period_s == pytest.approx(0.41 + 0.4 * (1 - 0.41 / 0.7))
    assert p.period_s > bound.period_s and p.bottleneck == "trainer" and p.trainer_s == p.period_s
    assert p.sampler_s == pytest.approx(0.41) and p.slowdown == pytest.approx(0.41 / 0.31)
    # Sampler-bound side by side: the sampler paces, the learner takes its shared step.
    slow = predict_lent_core(one, one, every, 2, shared=(0.9, 0.7))
    assert slow.bottleneck == "sampler" and slow.trainer_s == pytest.approx(0.7)
    assert slow.period_s == pytest.approx(0.7 + 0.31 * (1 - 0.7 / 0.91))
    # A bench faster side by side than alone is noise: no faster than alone.
    assert predict_lent_core(one, one, every, 2, shared=(0.1, 0.2)).period_s == pytest.approx(0.4)
    with pytest.raises(ValueError, match="shared seconds must be > 0"):
        predict_lent_core(one, one, every, 2, shared=(0.0, 0.7))


def test_rendezvous_waits_for_its_peer_and_works_meanwhile(tmp_path):
    from jaxrl_async.runtime.calibration import Rendezvous

    meet = Rendezvous(str(tmp_path), "sampler", "trainer", timeout_s=0.3)
    with pytest.raises(RuntimeError, match=r"co-run: trainer not ready after 0 s.*trainer\.ready"):
        meet.wait("ready")
    meet.timeout_s = 30.0
    peer = Rendezvous(str(tmp_path), "trainer", "sampler")
    calls = []

    def work():  # the peer marks "done" on the 10th call: the wait must keep working until then, no longer
        calls.append(1)
        if len(calls) == 10:
            peer.mark("done")

    meet.wait("done", work)
    assert len(calls) == 10  # it worked until the peer was done, and stopped as soon as it was


@pytest.mark.parametrize("role", ["sampler", "trainer"])
def test_corun_role_times_its_role_once_the_peer_is_ready(tmp_path, role):
    from test_orchestrator import _small

    from jaxrl_async.runtime.build import build_local
    from jaxrl_async.runtime.calibration import Rendezvous, calibration_config, corun_role

    peer = "trainer" if role == "sampler" else "sampler"
    meet_dir = tmp_path / "meet"
    meet_dir.mkdir()
    for what in ("ready", "done"):  # a peer that is there already
        (meet_dir / f"{peer}.{what}").touch()
    cfg = _small(tmp_path, **{"mesh.sampler": (1, 1), "mesh.trainer": (1, 1)})
    proc = build_local(calibration_config(cfg))
    try:
        with pytest.raises(ValueError, match="co-run role"):
            corun_role(proc, "learner", 1.0, Rendezvous(str(meet_dir), role, peer))
        d = corun_role(proc, role, 0.5, Rendezvous(str(meet_dir), role, peer))
    finally:
        proc.close()
    assert (meet_dir / f"{role}.ready").exists() and (meet_dir / f"{role}.done").exists()
    assert d["role"] == role and d["window_s"] >= 0.5
    if role == "sampler":
        assert 0 < d["sample_stream_s"] < d["window_s"] * 100
    else:
        assert d["train_steps"] >= 1 and 0 < d["train_micro_batch_s"] <= d["window_s"]


def test_the_overlap_ceiling_counts_the_drained_tail_on_top_of_the_overlap():
    from jaxrl_async.perf.shared_host import overlap_ceiling

    # Every core: sync samples a batch in 0.5 s and trains in 0.5 s. One core: each role twice as slow,
    # but streaming a batch costs 0.6 s against 1.0 s drained (tau = 1/0.6).
    every = _bench(w_s=0.3, w_t=0.5, batch_s=0.5)
    one = _bench(w_s=0.6, w_t=1.0, batch_s=1.0)
    c = overlap_ceiling(every, one)
    assert c["sync_period_s"] == pytest.approx(1.0) and c["async_period_s"] == pytest.approx(1.0)
    assert c["ceiling"] == pytest.approx(1.0) and c["f"] == pytest.approx(0.5)
    assert c["tau"] == pytest.approx(1.0 / 0.6)
    # A trainer that is no slower on one core: the sampler's stream paces the pinned pair.
    c = overlap_ceiling(every, _bench(w_s=0.6, w_t=0.5, batch_s=1.0))
    assert c["async_period_s"] == pytest.approx(0.6) and c["ceiling"] == pytest.approx(1.0 / 0.6)


def test_bench_async_compares_each_mode_at_its_own_best_slots():
    from jaxrl_async.perf.report import best_against_best

    def runs(*rates):
        return {s: {"steady_train_tokens_per_s": r} for s, r in zip((16, 64, 256), rates, strict=True)}

    best = best_against_best({"sync": runs(4000.0, 3300.0, 1450.0), "async": runs(3000.0, 4000.0, 5000.0)})
    assert best["sync"]["slots"] == 16 and best["async"]["slots"] == 256
    assert best["async"]["over_sync_best"] == pytest.approx(1.25) and best["sync"]["over_sync_best"] == 1.0
