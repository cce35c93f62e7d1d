"""benchmarks.bench_learning: its statistics (time to target, pairing, the default target) and a smoke run of
the command (sync and the pinned two-process async run, the report). The smoke leaves out the role benches
and the prediction (--nopredict): with them it took about 5 minutes on the loaded 2-core machine."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import learning_slots
from benchmarks import learning_study as ls

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _summary(evals, final, tokens_per_s, p50=8.0, p99=50.0, first_step_s=None):
    evals = [{"step": s, "accuracy": a, "elapsed_s": t + 5.0, "trained_s": t} for s, a, t in evals]
    return {"evals": evals, "final_accuracy": final, "steady_train_tokens_per_s": tokens_per_s,
            "completion_length_p50": p50, "completion_length_p99": p99,
            "first_step_s": first_step_s}  # fmt: skip


def test_time_to_target_reads_when_the_version_was_trained_not_when_its_eval_ended():
    evals = _summary([(0, 0.3, 0.0), (10, 0.55, 40.0), (20, 0.7, 80.0)], 0.7, 1.0)["evals"]
    assert ls.time_to_target(evals, 0.5) == (40.0, 10)
    assert ls.time_to_target(evals, 0.3) == (0.0, 0)  # reached at the start: no time needed
    assert ls.time_to_target(evals, 0.9) == (None, None)
    with pytest.raises(ValueError, match="trained_s"):
        ls.time_to_target([{"step": 3, "accuracy": 1.0, "elapsed_s": 1.0, "trained_s": None}], 0.5)


def test_compare_pairs_seeds_and_splits_the_speedup():
    sync = {0: _summary([(0, 0.3, 0.0), (10, 0.6, 100.0), (20, 0.8, 200.0)], 0.8, 100.0, first_step_s=20.0),
            1: _summary([(0, 0.3, 0.0), (10, 0.7, 100.0), (20, 0.82, 200.0)], 0.82, 100.0)}  # fmt: skip
    target = ls.default_target(list(sync.values()), 0.01)
    assert target == pytest.approx(0.80)
    async_ = {0: _summary([(0, 0.3, 0.0), (10, 0.5, 25.0), (20, 0.81, 50.0)], 0.81, 400.0, first_step_s=10.0),
              1: _summary([(0, 0.3, 0.0), (10, 0.6, 25.0), (20, 0.7, 50.0)], 0.70, 400.0)}  # fmt: skip
    rows = {"sync": {s: ls.run_row(v, target) for s, v in sync.items()},
            "async": {s: ls.run_row(v, target) for s, v in async_.items()}}  # fmt: skip
    report = ls.compare(rows)
    assert report["paired"][0]["speedup"] == pytest.approx(4.0)  # 200 s / 50 s
    assert report["paired"][0]["speedup_after_first_step"] == pytest.approx(4.5)  # 180 s / 40 s
    assert rows["sync"][1]["time_after_first_step_s"] is None  # no first-step time: no such figure
    assert report["paired"][0]["throughput_ratio"] == pytest.approx(4.0)
    assert report["paired"][0]["steps_ratio"] == pytest.approx(1.0)
    assert report["paired"][1]["speedup"] is None  # async seed 1 never reached the target
    assert report["speedup_mean"] == pytest.approx(4.0) and report["final_gap_mean"] == pytest.approx(-0.055)
    assert report["modes"]["async"]["reached_target"] == 1 and report["modes"]["sync"]["reached_target"] == 2
    assert rows["sync"][0]["length_p99_over_median"] == pytest.approx(50 / 8)
    assert "| mean | 4 | 4.5 | 4 | 1 |" in ls.table(report)
    # Late accuracy: the mean of the last LATE_EVALS (3) evaluations, a step's swing averaged out.
    assert ls.LATE_EVALS == 3 and rows["sync"][0]["late_accuracy"] == pytest.approx((0.3 + 0.6 + 0.8) / 3)
    assert ls.late_accuracy([{"step": s, "accuracy": s / 100} for s in (30, 0, 10, 20)]) == pytest.approx(0.2)
    assert ls.late_accuracy([]) is None
    assert report["paired"][1]["late_gap"] == pytest.approx((0.6 + 0.7 - 0.7 - 0.82) / 3)
    assert report["late_gap_mean"] == pytest.approx(((0.5 + 0.81 - 0.6 - 0.8) + (0.6 + 0.7 - 0.7 - 0.82)) / 6)
    assert "late async - sync (mean of the last 3 evaluations)" in ls.table(report)
    with pytest.raises(ValueError, match="--target"):
        ls.default_target([{"final_accuracy": None}], 0.01)


def _two_seeds():
    """Seed 0: sync ends at 0.80, async gets there 4x sooner; seed 1: sync ends at 0.60, below the common
    target, async gets to 0.59 at 25 s against sync's 100 s."""
    sync = {0: _summary([(0, 0.3, 0.0), (10, 0.6, 100.0), (20, 0.8, 200.0)], 0.8, 100.0),
            1: _summary([(0, 0.3, 0.0), (10, 0.59, 100.0), (20, 0.6, 200.0)], 0.6, 100.0)}  # fmt: skip
    async_ = {0: _summary([(0, 0.3, 0.0), (10, 0.5, 25.0), (20, 0.81, 50.0)], 0.81, 400.0),
              1: _summary([(0, 0.3, 0.0), (10, 0.59, 25.0), (20, 0.62, 50.0)], 0.62, 200.0)}  # fmt: skip
    return {"sync": sync, "async": async_}


def test_each_seed_against_its_own_target_counts_every_seed_and_gives_t_intervals():
    runs = _two_seeds()
    common = ls.default_target(list(runs["sync"].values()), 0.01)  # 0.69: seed 1's sync never gets there
    report = ls.compare({m: {s: ls.run_row(v, common) for s, v in by.items()} for m, by in runs.items()})
    assert report["paired"][1]["speedup"] is None and report["speedup_ci95"]["n"] == 1
    assert report["speedup_ci95"]["lo"] is None  # one pair: no interval
    targets = ls.seed_targets(runs["sync"], 0.01)
    assert targets == pytest.approx({0: 0.79, 1: 0.59})
    own = ls.compare({m: {s: ls.run_row(v, targets[s]) for s, v in by.items()} for m, by in runs.items()})
    assert own["modes"]["sync"]["reached_target"] == 2 and own["modes"]["async"]["reached_target"] == 2
    assert own["paired"][0]["speedup"] == pytest.approx(4.0)  # 200 s / 50 s
    assert own["paired"][1]["speedup"] == pytest.approx(4.0) and own["paired"][1]["steps_ratio"] == 1.0
    assert own["paired"][1]["throughput_ratio"] == pytest.approx(2.0)
    ci = own["throughput_ratio_ci95"]  # ratios 4 and 2: mean 3, t(0.975, 1 df) = 12.706, sd / sqrt(2) = 1
    assert ci["n"] == 2 and ci["mean"] == pytest.approx(3.0)
    assert ci["lo"] == pytest.approx(3.0 - 12.706, abs=1e-3)
    assert ci["hi"] == pytest.approx(3.0 + 12.706, abs=1e-3)
    text = ls.own_target_table(own, targets)
    assert "sync reached it in 2 of 2, async in 2 of 2" in text
    assert "| 1 | 0.59 | 4 |" in text and "| 95% t interval |  | 4 to 4 (n = 2) |" in text
    assert ls.seed_targets({0: {"final_accuracy": None}}, 0.01) == {}


def test_report_reads_kept_runs_back_without_running_anything(tmp_path):
    for mode, by in _two_seeds().items():
        for seed, summary in by.items():
            (tmp_path / f"{mode}_s{seed}").mkdir()
            (tmp_path / f"{mode}_s{seed}" / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "warm_up_sync").mkdir()  # not a seed's run: left out
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    tool = ["-m", "benchmarks.bench_learning"]
    out = tmp_path / "report.json"
    res = subprocess.run([sys.executable, *tool, f"--report={tmp_path}", "--margin=0.01", f"--out={out}"],
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["seeds"] == [0, 1] and report["settings"]["target"] == pytest.approx(0.69)
    assert report["paired"]["0"]["speedup"] == pytest.approx(4.0) and report["paired"]["1"]["speedup"] is None
    assert report["own_targets"]["paired"]["1"]["speedup"] == pytest.approx(4.0)
    assert "target held-out accuracy 0.690" in res.stdout and "sync reached it in 2 of 2" in res.stdout
    averaged = report["seed_averaged"]  # benchmarks.time_to_target, both seeds counted
    assert averaged["seeds"] == [0, 1] and "seed-averaged curves (2 paired seeds)" in res.stdout
    # --seeds picks; a directory without the runs is refused, named.
    res = subprocess.run([sys.executable, *tool, f"--report={tmp_path}", "--seeds=1", f"--out={out}"],
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0 and json.loads(out.read_text())["settings"]["seeds"] == [1], res.stderr[-2000:]
    empty = tmp_path / "empty"
    empty.mkdir()
    res = subprocess.run([sys.executable, *tool, f"--report={empty}"], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert res.returncode != 0 and f"--report={empty}: no sync_s<seed>/summary.json" in res.stderr
    # Two directories' seeds pool; a seed in both is refused.
    more = tmp_path / "more"
    for mode, summary in (("sync", _two_seeds()["sync"][0]), ("async", _two_seeds()["async"][0])):
        (more / f"{mode}_s7").mkdir(parents=True)
        (more / f"{mode}_s7" / "summary.json").write_text(json.dumps(summary))
    res = subprocess.run([sys.executable, *tool, f"--report={tmp_path},{more}", f"--out={out}"], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0 and json.loads(out.read_text())["settings"]["seeds"] == [0, 1, 7], res.stderr
    res = subprocess.run([sys.executable, *tool, f"--report={tmp_path},{tmp_path}"], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode != 0 and f"sync seed 0 is in both {tmp_path} and {tmp_path}" in res.stderr


def test_overlap_bound_is_the_core_count_over_how_well_sync_uses_the_cores():
    one, every = ls.run_row(_summary([], 0.5, 600.0), 0.5), ls.run_row(_summary([], 0.5, 1000.0), 0.5)
    b = ls.overlap_bound(one, every, 2)
    assert b["core_scaling"] == pytest.approx(1000 / 600) and b["bound"] == pytest.approx(1.2)
    assert ls.overlap_bound(ls.run_row(_summary([], 0.5, None), 0.5), every, 2)["bound"] is None


def test_the_slot_sweep_gives_each_mode_its_own_best_engine_size():
    # A slotted engine: sync (drains each batch) peaks at few slots, async (keeps them full) at more.
    rates = {("sync", 32): 4100.0, ("sync", 128): 2500.0, ("async", 32): 4500.0, ("async", 128): 5200.0}
    calls = []

    def probe(mode, n):
        calls.append((mode, n))
        return {"steady_train_tokens_per_s": rates[mode, n], "completion_length_p50": 24.0, "extra": 1}

    result = learning_slots.sweep(ls.MODES, [32, 128], probe)
    assert calls == [("sync", 32), ("sync", 128), ("async", 32), ("async", 128)]  # one probe each
    assert result["best"]["sync"]["slots"] == 32 and result["best"]["async"]["slots"] == 128
    assert result["best"]["async"]["over_sync_best"] == pytest.approx(5200 / 4100)
    assert "extra" not in result["runs"]["sync"][32]
    text = learning_slots.table(result)
    assert "| sync | **4,100** | 2,500 |" in text and "| async | 4,500 | **5,200** |" in text
    assert learning_slots.parse(["64", "128"]) == [64, 128]
    for bad in (["64", "x"], ["0"], ["64", "64"]):
        with pytest.raises(ValueError, match="--slot-sweep"):
            learning_slots.parse(bad)


def test_smoke_runs_every_part_of_the_command(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "benchmarks.bench_learning", "--smoke", "--nopredict",
           "--one-core", "--out", str(out), "--keep", str(tmp_path / "runs")]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "task reference completions: median" in res.stdout
    assert "each seed's own target (its sync final minus the margin): sync reached it in 1 of 1" in res.stdout
    report = json.loads(out.read_text())
    # The held-out set's coarseness: 8 weighted ranges (--smoke), the heaviest above the mean share.
    resolution = report["settings"]["eval_resolution"]
    assert resolution["prompts"] == 8 and 1 / 8 < resolution["heaviest"] < 1
    assert (
        f"held-out set: 8 prompts; one of them answered differently moves the accuracy by up to "
        f"{resolution['heaviest']:.3f}" in res.stdout
    )
    assert report["settings"]["smoke"] and report["settings"]["seeds"] == [0] and report["predictions"] == []
    # What --report needs to predict again, written beside the runs before they start.
    kept = json.loads((tmp_path / "runs" / "settings.json").read_text())
    assert kept["setup"] == {"max_staleness": 2, "processes": 2, "prompts": 4, "samples": 2,
                             "lent_core": False}
    assert kept["lengths"] == report["settings"]["lengths"]
    assert kept["lengths"]["p99"] > kept["lengths"]["median"]
    for mode in ("sync", "async"):
        row = report["rows"][mode]["0"]
        assert 0.0 <= row["final_accuracy"] <= 1.0 and row["steady_train_tokens_per_s"] > 0
        assert 0 < row["completion_length_p50"] <= row["completion_length_p99"]
    assert report["rows"]["sync"]["0"]["staleness_max"] == 0
    assert report["rows"]["async"]["0"]["staleness_max"] >= 1
    assert (tmp_path / "runs" / "async_s0.log").exists()  # the pinned two-process run
    # --compile-cache=warm (the default): an untimed run of each mode filled the cache first, and the
    # timed runs' learner processes loaded every program from it.
    assert report["settings"]["compile_cache"] == "warm"
    for mode in ("sync", "async"):
        assert (tmp_path / "runs" / f"warm_up_{mode}.log").exists()
        assert f"compile cache warm-up, {mode}:" in res.stdout
        row = report["rows"][mode]["0"]
        assert row["compiles"] > 0 and row["compiles_loaded"] == row["compiles"], row
        assert 0 < row["first_step_s"] < row["wall_s"]
    # The async sampler's process (process 1) loaded every program of its own store, which JAX's cache
    # would not have kept for it.
    row = report["rows"]["async"]["0"]
    assert row["sampler_programs_loaded"] > 0 and row["sampler_programs_compiled"] == 0, row
    assert report["rows"]["sync"]["0"]["sampler_programs_loaded"] is None
    bound = report["overlap_bound"]  # --one-core: sync again on one core
    assert bound["cores"] == len(os.sched_getaffinity(0)) and bound["one_core_tokens_per_s"] > 0
    assert (tmp_path / "runs" / "sync_s0_cores1.log").exists() and "overlap alone" in res.stdout


def test_a_bad_async_cpu_sets_is_refused_before_anything_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    tool = ["-m", "benchmarks.bench_learning"]
    cases = [(["--async-cpu-sets=0"], "--async-cpu-sets=0: 1 core lists for 2 processes"),
             (["--async-cpu-sets=0:0", "--async-processes=1"], "needs --async-processes 2"),
             ([f"--workload-from={tmp_path}"], "the ones this command reports or makes, not earlier runs"),
             (["--workload-from=/nonexistent", "--nopredict"], "--nopredict leaves out")]  # fmt: skip
    for flags_, msg in cases:
        res = subprocess.run([sys.executable, *tool, "--smoke", "--keep", str(tmp_path), *flags_], env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert res.returncode != 0 and msg in res.stderr, res.stderr[-2000:]
        assert not os.listdir(tmp_path)  # no role bench, warm start or run began


# A role bench as benchmarks/bench_roles.py writes it (figures of a letter_range run on one core).
_DECODE = {
    "slots": 128,
    "busy_of_run_engine": [[1, 0.0038], [4, 0.0036], [16, 0.0026], [64, 0.0026], [128, 0.0025]],
    "engine_of_b_slots": [[1, 0.00019], [4, 0.00017], [16, 0.00033], [64, 0.00125], [128, 0.0032]],
}
_BENCH = {"sampler_devices": 1, "trainer_devices": 1, "cores": 1, "num_slots": 128, "steps_per_call": 4,
          "samples_per_batch": 512, "tokens_per_batch": 13930.0, "completion_length_mean": 17.3,
          "sample_batch_s": 0.47, "sample_batch_cpu_s": 0.45, "sample_stream_s": 0.47,
          "sample_stream_cpu_s": 0.45, "train_step_s": 0.965, "train_step_cpu_s": 0.965, "update_s": 0.001,
          "decode": _DECODE}  # fmt: skip


def test_the_realized_prediction_puts_the_runs_own_train_steps_and_lengths_in_the_model():
    setup = ls.Setup(max_staleness=2, processes=2, prompts=64, samples=8)
    benches = {"every": {**_BENCH, "cores": 2, "train_step_s": 0.705}, "one": _BENCH}
    lengths = {"median": 8.0, "p99": 51.0, "max": 53}

    def rows(sync_step, async_step, p50=8.0, p99=51.0):
        def row(step):
            return {"train_step_s_mean": step, "completion_length_p50": p50, "completion_length_p99": p99}

        return {"sync": {0: row(sync_step)}, "async": {0: row(async_step), 1: row(async_step)}}

    before = ls.predict(benches, setup, lengths)
    same = ls.predict_realized(benches, setup, lengths, rows(0.705, 0.965))
    assert same["ratio"] == pytest.approx(before["ratio"])  # what the role benches showed: no change
    assert same["train_step_s"] == {"sync": 0.705, "async": 0.965, "role_bench_every_core": 0.705,
                                    "role_bench_one_core": 0.965}  # fmt: skip
    # The trainer's work shrank in the runs (more groups skipped as the policy learned): sync, whose
    # step is sampling then training, gains more than trainer-bound async, so the ratio falls.
    drift = ls.predict_realized(benches, setup, lengths, rows(0.47, 0.90))
    assert drift["sync"]["tokens_per_s"] == pytest.approx(13930.0 / (0.47 + 0.001 + 0.47))
    assert drift["async"]["tokens_per_s"] > before["async"]["tokens_per_s"]
    assert drift["ratio"] < before["ratio"]
    longer = ls.predict_realized(benches, setup, lengths, rows(0.47, 0.90, 20.0, 52.0))
    assert longer["lengths"]["median"] == 20.0 and longer["lengths"]["p99"] == 52.0
    assert ls.predict_realized(benches, setup, lengths, rows(None, 0.9)) is None  # a run without the figure
    # One process: both modes ran on every core, and each takes its own runs' step there.
    one = ls.Setup(max_staleness=2, processes=1, prompts=64, samples=8)
    shared = ls.predict_realized(benches, one, lengths, rows(0.47, 0.60))
    assert shared["sync"]["tokens_per_s"] == pytest.approx(13930.0 / (0.47 + 0.001 + 0.47))
    assert shared["async"] == ls.predict({**benches, "every": {**benches["every"], "train_step_s": 0.60}},
                                         one, lengths)["async"]  # fmt: skip


def test_lending_the_sampler_core_to_the_learner_is_predicted_with_its_own_form():
    benches = {"every": {**_BENCH, "cores": 2, "train_step_s": 0.705}, "one": _BENCH}
    lengths = {"median": 8.0, "p99": 51.0, "max": 53}
    pinned = ls.predict(benches, ls.Setup(max_staleness=2, processes=2, prompts=64, samples=8), lengths)
    lent = ls.predict(benches, ls.Setup(max_staleness=2, processes=2, prompts=64, samples=8, lent_core=True),
                      lengths)
    assert lent["sync"] == pinned["sync"] and lent["best_split_16_cores"] == pinned["best_split_16_cores"]
    # The learner: 0.965 s on one core, 0.705 on both; the sampler keeps its core busy 0.471 s a batch
    # (its stream, 0.47, and the weight update).
    v1, v2 = 1 / 0.965, 1 / 0.705
    step = (1 + 0.471 * (v2 - v1)) / v2
    assert lent["async"]["trainer_s"] == pytest.approx(step) and 0.705 < step < 0.965
    assert lent["async"]["tokens_per_s"] == pytest.approx(13930.0 / step)
    lens = {"completion_length_p50": 8.0, "completion_length_p99": 51.0}
    rows = {"sync": {0: {"train_step_s_mean": 0.5, **lens}}, "async": {0: {"train_step_s_mean": 0.6, **lens}}}
    realized = ls.predict_realized(benches, ls.Setup(2, 2, 64, 8, lent_core=True), lengths, rows)
    assert realized["async"]["period_s"] == pytest.approx(0.6)  # the learner's step as the runs took it
    assert realized["ratio"] == pytest.approx((13930.0 / 0.6) / realized["sync"]["tokens_per_s"])
    # With the co-run benches: the sampler 0.6 s a batch beside the learner, the learner 0.4 s a
    # micro-batch (times 2.5 micro-batches a step) beside the sampler.
    corun = {"sampler": {"sample_stream_s": 0.6}, "trainer": {"train_micro_batch_s": 0.4}}
    every = {**benches["every"], "train_micro_batches": 2.5}
    assert ls.shared_paces(corun, every) == pytest.approx((0.6, 1.0)) and ls.shared_paces(None, every) is None
    both = {"every": every, "one": _BENCH, "corun": corun}
    shared = ls.predict(both, ls.Setup(max_staleness=2, processes=2, prompts=64, samples=8, lent_core=True),
                        lengths)
    period = 0.601 + 0.705 * (1 - 0.601 / 1.0)  # side by side for the sampler's 0.601 s, then alone
    assert shared["async"]["period_s"] == pytest.approx(period)
    assert shared["async"]["shared_paces_s"] == pytest.approx([0.6, 1.0])
    assert shared["async"]["tokens_per_s_without_corun"] == pytest.approx(lent["async"]["tokens_per_s"])
    assert shared["ratio"] < lent["ratio"] and shared["sync"] == lent["sync"]
    # The realized prediction takes the runs' own step, which already holds the slowing: no co-run in it.
    assert (
        ls.predict_realized(both, ls.Setup(2, 2, 64, 8, lent_core=True), lengths, rows)["async"]
        == realized["async"]
    )


def test_the_16_core_split_is_given_within_max_staleness_and_at_any_eta_with_the_eta_it_needs():
    benches = {"every": {**_BENCH, "cores": 2, "train_step_s": 0.705}, "one": _BENCH}
    lengths = {"median": 8.0, "p99": 51.0, "max": 53}
    p = ls.predict(benches, ls.Setup(max_staleness=2, processes=2, prompts=64, samples=8), lengths)
    within, anyway = p["best_split_16_cores"], p["best_split_16_cores_any_max_staleness"]
    assert anyway["cores"] == 16 and anyway["sampler_devices"] + anyway["trainer_devices"] == 16
    assert anyway["tokens_per_s"] >= (within["tokens_per_s"] if within else 0)
    needed = anyway["max_staleness_needed"]
    assert needed >= 2 and needed >= anyway["max_staleness"] - 1e-9
    assert needed > 2 and within["sampler_devices"] != anyway["sampler_devices"]  # η binds here
    line = ls.host_split_line(p, 2)
    assert line.startswith("split model, a 16-core host: ")
    assert f"{anyway['sampler_devices']} sampler + {anyway['trainer_devices']} trainer cores" in line
    # At the η the best split needs, it holds η and the model picks it as the best within η.
    needed = ls.Setup(max_staleness=anyway["max_staleness_needed"], processes=2, prompts=64, samples=8)
    eased = ls.predict(benches, needed, lengths)
    assert eased["best_split_16_cores"]["sampler_devices"] == anyway["sampler_devices"]
    assert "needs η" not in ls.host_split_line(eased, anyway["max_staleness_needed"])
    one = ls.predict(benches, ls.Setup(max_staleness=2, processes=1, prompts=64, samples=8), lengths)
    assert one["best_split_16_cores_any_max_staleness"] is None and ls.host_split_line(one, 2) is None
    assert ls.host_max_staleness_line(one) is None
    # What each η buys: η 1 up to one past the η the best split needs. A looser bound never loses
    # throughput; the row at the run's η is the best within it, the row at the η needed is the best at any η.
    by = p["best_split_16_cores_by_max_staleness"]
    assert [r["max_staleness"] for r in by] == list(range(1, anyway["max_staleness_needed"] + 2))
    tokens = [r["tokens_per_s"] for r in by]
    assert tokens == sorted(tokens) and tokens[0] < tokens[-1]
    at_run = by[1]
    assert at_run["sampler_devices"] == within["sampler_devices"]
    assert at_run["tokens_per_s"] == within["tokens_per_s"]
    at_needed = by[anyway["max_staleness_needed"] - 1]
    assert (at_needed["sampler_devices"], at_needed["tokens_per_s"]) == (
        anyway["sampler_devices"],
        pytest.approx(anyway["tokens_per_s"], rel=1e-6),
    )
    assert by[-1]["tokens_per_s"] == pytest.approx(at_needed["tokens_per_s"])  # past it, η buys nothing more
    for r in by:
        assert r["sampler_devices"] in r["near_best_sampler_devices"]
    line = ls.host_max_staleness_line(p)
    assert line.startswith("split model, a 16-core host, best split")
    cores = f"{within['sampler_devices']} + {within['trainer_devices']}"
    assert f"η 2: {cores}, {within['tokens_per_s']:,.0f}" in line
    flat = {"best_split_16_cores_by_max_staleness": [
        {"max_staleness": 1, "sampler_devices": None},
        {"max_staleness": 2, "sampler_devices": 9, "trainer_devices": 7, "tokens_per_s": 1000.0,
         "near_best_sampler_devices": [8, 9, 10]}]}  # fmt: skip
    assert ls.host_max_staleness_line(flat).endswith(
        "η 1: no split holds it; η 2: 9 + 7, 1,000 (within 5% of it: 8, 9, 10 sampler cores)"
    )


def _kept(root, seeds, max_staleness, step=(0.5, 0.7), benches=True):
    """A --keep directory: both modes' summaries of `seeds` (async at η = η) and the role benches."""
    for mode, by in _two_seeds().items():
        for seed in seeds:
            summary = {**by[seed % 2], "max_staleness": max_staleness if mode == "async" else 0,
                       "processes": 2 if mode == "async" else 1,
                       "train_step_s_mean": step[mode == "async"]}  # fmt: skip
            (root / f"{mode}_s{seed}").mkdir(parents=True)
            (root / f"{mode}_s{seed}" / "summary.json").write_text(json.dumps(summary))
    if benches:
        (root / "roles_every_core.json").write_text(json.dumps({**_BENCH, "cores": 2, "train_step_s": 0.705}))
        (root / "roles_one_core.json").write_text(json.dumps(_BENCH))


def test_report_predicts_again_from_each_directorys_own_role_benches(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    tool = ["-m", "benchmarks.bench_learning"]
    benches = {"every": {**_BENCH, "cores": 2, "train_step_s": 0.705}, "one": _BENCH}
    # A directory with the settings a run writes: its prediction is the model's on its benches exactly.
    recorded, lengths = tmp_path / "recorded", {"median": 8.0, "p99": 51.0, "max": 53}
    _kept(recorded, [0, 1], max_staleness=2)
    setup = {"max_staleness": 2, "processes": 2, "prompts": 64, "samples": 8, "lent_core": False}
    (recorded / "settings.json").write_text(json.dumps({"setup": setup, "lengths": lengths}))
    # One from before settings.json: η from its runs' summaries, not the --η default; its own benches,
    # slower on every core, so its prediction differs.
    older = tmp_path / "older"
    _kept(older, [2, 3], max_staleness=2, step=(0.3, 0.6))
    (older / "roles_every_core.json").write_text(json.dumps({**_BENCH, "cores": 2, "train_step_s": 0.9}))
    out = tmp_path / "report.json"
    res = subprocess.run([sys.executable, *tool, f"--report={recorded},{older}", f"--out={out}"], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    first, second = json.loads(out.read_text())["predictions"]
    assert first["root"] == str(recorded) and first["seeds"] == [0, 1]
    assert first["settings_from"] == str(recorded / "settings.json")
    before = ls.predict(benches, ls.Setup(**setup), lengths)
    assert first["prediction"]["ratio"] == pytest.approx(before["ratio"])
    assert first["measured_throughput_ratio"] == pytest.approx(3.0)  # seeds' 4 and 2

    def row(step):  # what _kept's summaries realized: their train step, _summary's lengths
        return {"train_step_s_mean": step, "completion_length_p50": 8.0, "completion_length_p99": 50.0}

    rows = {"sync": {0: row(0.5), 1: row(0.5)}, "async": {0: row(0.7), 1: row(0.7)}}
    realized = ls.predict_realized(benches, ls.Setup(**setup), lengths, rows)
    assert first["prediction_realized"]["ratio"] == pytest.approx(realized["ratio"])
    assert second["seeds"] == [2, 3] and second["settings_from"] == "runs"
    assert second["setup"]["max_staleness"] == 2 and not second["setup"]["lent_core"]
    assert second["prediction"]["ratio"] != pytest.approx(first["prediction"]["ratio"])
    assert second["prediction_realized"]["train_step_s"]["sync"] == pytest.approx(0.3)
    ratio = first["prediction"]["ratio"]
    line = f"throughput async / sync [{recorded}, seeds 0,1]: predicted {ratio:.2f}, measured 3.00"
    assert line in res.stdout
    assert f"({older} has no settings.json: η = 2 and 2 process(es) from its runs" in res.stdout
    # --workload-from: the same prediction given the train steps and lengths that earlier runs realized.
    res = subprocess.run([sys.executable, *tool, f"--report={recorded}", f"--workload-from={older}",
                          f"--out={out}"], env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    (made,) = json.loads(out.read_text())["predictions"]
    earlier = {"sync": {2: row(0.3), 3: row(0.3)}, "async": {2: row(0.6), 3: row(0.6)}}
    drifted = ls.predict_realized(benches, ls.Setup(**setup), lengths, earlier)["ratio"]
    assert made["earlier_runs"] == [str(older)]
    assert made["prediction_from_earlier_runs"]["ratio"] == pytest.approx(drifted)
    assert made["prediction"]["ratio"] == pytest.approx(before["ratio"])  # the warm start's, as it was
    assert f"({older}: sync 0.300 s, async 0.600 s, η = 2): predicted {drifted:.2f}" in res.stdout
    for flags_, msg in (([f"--report={recorded}", f"--workload-from={recorded}"], "not earlier runs"),
                        ([f"--report={recorded}", f"--workload-from={tmp_path}"],
                         f"--workload-from={tmp_path}: no sync_s<seed>/summary.json")):  # fmt: skip
        res = subprocess.run([sys.executable, *tool, *flags_], env=env, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
        assert res.returncode != 0 and msg in res.stderr, res.stderr[-2000:]
    # η from the runs, and no pooling across η.
    max_staleness3 = tmp_path / "max_staleness3"
    _kept(max_staleness3, [4], max_staleness=3)
    res = subprocess.run([sys.executable, *tool, f"--report={max_staleness3}", f"--out={out}"], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0
    assert json.loads(out.read_text())["predictions"][0]["setup"]["max_staleness"] == 3
    res = subprocess.run([sys.executable, *tool, f"--report={recorded},{max_staleness3}"], env=env,
                         capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert res.returncode != 0
    pooled = f"different staleness bounds ({recorded}: η = 2; {max_staleness3}: η = 3); they do not pool"
    assert pooled in res.stderr
