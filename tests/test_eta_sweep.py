"""benchmarks.eta_sweep: paired cells, the confidence interval, and the report from the cells' summaries."""

import json
import os
import subprocess
import sys

import jax
import pytest

from benchmarks import eta_study
from benchmarks.configs import eta_sweep as sweep_config
from jaxrl_async.data import make_prompt_iterator
from jaxrl_async.run_config import validate
from jaxrl_async.runtime import build
from jaxrl_async.trainer.warmstart import cache_key

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = ["-m", "benchmarks.eta_sweep"]


def test_mean_ci_golden():
    c = eta_study.mean_ci([0.1, 0.2, 0.3, 0.0])
    # mean 0.15, sample sd sqrt(0.05 / 3), t(0.975, 3 dof) = 3.182446305284263
    half = 3.182446305284263 * (0.05 / 3) ** 0.5 / 2
    assert c["n"] == 4 and c["mean"] == pytest.approx(0.15)
    assert c["lo"] == pytest.approx(0.15 - half) and c["hi"] == pytest.approx(0.15 + half)
    assert eta_study.mean_ci([0.2])["lo"] is None and eta_study.mean_ci([])["mean"] is None


def test_grid_is_lags_per_rate_with_one_sync_cell_at_lag_zero():
    grid = eta_study.parse_grid("1e-4:0,8,32;3e-4:0,8")
    assert grid == [(1e-4, [0, 8, 32]), (3e-4, [0, 8])]
    cells = eta_study.cells(grid, [4], ["ppo", "m2po"], [0, 1])
    lag0 = [c for c in cells if c["lag"] == 0 and not c["max_staleness"]]
    assert {c["arm"] for c in lag0} == {"sync"} and len(lag0) == 4
    assert len([c for c in cells if c["lag"] == 32]) == 4
    assert len([c for c in cells if c["max_staleness"] == 4]) == 4
    assert len({c["name"] for c in cells}) == len(cells)
    with pytest.raises(ValueError, match="unknown arm"):
        eta_study.cells(grid, [], ["nope"], [0])


def _run_config(cell, workdir):
    c = sweep_config.get_config()
    for k, v in eta_study.cell_overrides(cell, str(workdir), 20).items():
        *path, last = k.split(".")
        target = c
        for p in path:
            target = target[p]
        target[last] = v
    return validate(c, len(jax.devices()))


def test_paired_cells_share_warm_start_data_order_and_sampling_seed(tmp_path):
    runs = {}
    for arm, seed in (("ppo", 3), ("m2po", 3), ("robust", 3), ("ppo", 4)):
        cell = dict(lr=1e-4, lag=8, max_staleness=0, arm=arm, seed=seed)
        runs[arm, seed] = _run_config(cell, tmp_path / f"{arm}{seed}")
    tok = build.build_tokenizer(runs["ppo", 3])

    def warm_key(run):
        model_cfg = build.model_config(run, tok)
        return cache_key(model_cfg, run.data, run.warm_start, run.seed, tok.vocab_size, run.eval.prompts)

    def first_prompts(run):
        it = make_prompt_iterator(run.data, tok)
        return [next(it).text for _ in range(6)]

    ref = runs["ppo", 3]
    assert ref.trainer.controlled_lag == 8 and ref.schedule.mode == "sync" and ref.trainer.lr == 1e-4
    for arm in ("m2po", "robust"):
        run = runs[arm, 3]
        assert run.trainer.loss != ref.trainer.loss or run.trainer.ess_scaled_step
        assert warm_key(run) == warm_key(ref) and first_prompts(run) == first_prompts(ref)
        assert run.seed == ref.seed  # the actors' sampling keys are seed * 1_000_003 + admission number
    other = runs["ppo", 4]
    assert warm_key(other) != warm_key(ref) and first_prompts(other) != first_prompts(ref)


def _summary(acc_by_step):
    evals = [{"step": s, "accuracy": a, "elapsed_s": 1.0 * s} for s, a in acc_by_step.items()]
    return {"steps": max(acc_by_step), "evals": evals}


def test_report_gives_paired_differences_gaps_to_sync_and_collapses(tmp_path):
    accs = {  # lr 1e-4: sync, and lag 8 for ppo and m2po, two seeds
        "lr0.0001_lag0_sync_s0": {0: 0.3, 10: 0.5, 20: 0.6},
        "lr0.0001_lag0_sync_s1": {0: 0.3, 10: 0.4, 20: 0.6},
        "lr0.0001_lag8_ppo_s0": {0: 0.3, 10: 0.3, 20: 0.1},  # collapsed: 0.1 < 0.3 - 0.1
        "lr0.0001_lag8_ppo_s1": {0: 0.3, 10: 0.4, 20: 0.4},
        "lr0.0001_lag8_m2po_s0": {0: 0.3, 10: 0.5, 20: 0.5},
        "lr0.0001_lag8_m2po_s1": {0: 0.3, 10: 0.5, 20: 0.6},
        "lr0.0001_lag8_decoupled_mask_s0": {0: 0.3},  # stopped before its first evaluation: left out
    }
    for name, a in accs.items():
        os.makedirs(tmp_path / name)
        (tmp_path / name / "summary.json").write_text(json.dumps(_summary(a)))
    arms = "ppo,m2po,decoupled_mask"
    cmd = [sys.executable, *TOOL, "--out", str(tmp_path), "--grid", "1e-4:0,8", "--arms", arms,
           "--seeds", "0,1", "--report-only"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert "lr0.0001_lag8_decoupled_mask_s0: no evaluation after step 0" in res.stderr
    assert "lr0.0001_lag8_decoupled_mask_s1: no evaluation after step 0" in res.stderr  # no cell at all
    report = json.loads((tmp_path / "eta_sweep.json").read_text())
    assert report["common_eval_step"] == 20
    rows = {(r["lag"], r["arm"]): r for r in report["rows"]}
    # Run means (steps 10 and 20): sync 0.55, 0.5; ppo 0.2, 0.4; m2po 0.5, 0.55.
    m2po = rows[8, "m2po"]
    assert m2po["vs_naive"]["mean"] == pytest.approx((0.3 + 0.15) / 2)
    assert m2po["gap_to_sync"]["mean"] == pytest.approx((-0.05 + 0.05) / 2)
    assert rows[8, "ppo"]["vs_naive"] is None and rows[8, "ppo"]["collapses"] == 1
    assert rows[0, "sync"]["gap_to_sync"] is None and m2po["collapses"] == 0
    assert (tmp_path / "eta_sweep.png").stat().st_size > 10_000
    assert "| 0.0001 | lag 8 | m2po | 2 | 0.525 | +0.225 [" in res.stdout


def test_verdict_follows_the_preregistered_rule():
    ci = lambda lo, hi: {"n": 12, "mean": (lo + hi) / 2, "lo": lo, "hi": hi}
    v = eta_study.verdict
    assert v("decoupled_mask", ci(-0.019, 0.015)) == "level"
    assert v("decoupled_mask", ci(-0.021, 0.015)) == "unresolved"  # reaches past -2 points
    assert v("robust", ci(-0.06, -0.021)) == "worse"
    assert v("robust", ci(-0.06, -0.01)) == "unresolved"
    assert v("ppo", ci(-0.05, -0.001)) == "worse" and v("ppo", ci(-0.05, 0.001)) == "not shown worse"
    assert v("sync", None) is None and v("ppo", {"n": 1, "mean": 0.0, "lo": None, "hi": None}) is None


def test_expected_reward_figures_leave_out_incomplete_cells():
    """The pre-registered metric is the expected reward's run mean, paired with sync within a seed; a cell
    stopped at a deadline (last evaluation before --steps) is left out rather than shortening every cell's
    comparison window."""
    cell = lambda arm, lag, seed, er, last=20: {
        "lr": 1e-4, "lag": lag, "max_staleness": 0, "arm": arm, "seed": seed, "name": f"{arm}{seed}",
        "evals": {0: 0.3, 10: 0.5, last: 0.6}, "expected": {0: 0.2, 10: er[0], last: er[1]},
    }  # fmt: skip
    results = [cell("sync", 0, 0, (0.40, 0.50)), cell("sync", 0, 1, (0.30, 0.40)),
               cell("decoupled_mask", 8, 0, (0.39, 0.50)), cell("decoupled_mask", 8, 1, (0.30, 0.38)),
               cell("decoupled_mask", 8, 2, (0.1, 0.1), last=15)]  # fmt: skip
    report = eta_study.compare(results, steps=20)
    assert report["common_eval_step"] == 20 and results[-1]["incomplete"]
    rows = {r["arm"]: r for r in report["rows"]}
    dm = rows["decoupled_mask"]
    assert dm["seeds"] == 2
    # run means: sync 0.45, 0.35; decoupled 0.445, 0.34 -> gaps -0.005, -0.01
    assert dm["er_gap_to_sync"]["mean"] == pytest.approx(-0.0075)
    assert dm["final_er"]["mean"] == pytest.approx(0.44) and dm["final_er"]["se"] == pytest.approx(0.06)
    assert dm["final_accuracy"]["mean"] == pytest.approx(0.6)
    assert dm["verdict"] == eta_study.verdict("decoupled_mask", dm["er_gap_to_sync"])
    assert rows["sync"]["er_run_mean"]["mean"] == pytest.approx(0.40) and rows["sync"]["verdict"] is None
    table = eta_study.preregistered_table(report)
    assert "| 0.0001 | lag 8 | decoupled_mask | 2 | 0.3925 | -0.008 [" in table
