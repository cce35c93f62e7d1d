"""tools/eta_sweep.py: the grid it runs and the report it writes from the cells' summaries."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "eta_sweep.py")


def _summary(acc_by_step, staleness):
    evals = [{"step": s, "accuracy": a, "elapsed_s": 10.0 * s} for s, a in acc_by_step.items()]
    return {
        "steps": max(acc_by_step), "evals": evals, "final_accuracy": evals[-1]["accuracy"], "wall_s": 100.0,
        "steady_train_tokens_per_s": 1000.0, "staleness_mean": staleness, "staleness_max": staleness,
        "token_staleness_mean": staleness, "filtered_groups": 0,
    }  # fmt: skip


def test_report_compares_cells_at_the_common_step_and_skips_ppo_at_eta_zero(tmp_path):
    cells = {  # one cell stopped early (deadline) at step 20: the common step is 20
        "eta0_decoupled_ppo_s0": ({0: 0.3, 10: 0.5, 20: 0.6, 30: 0.7}, 0.0),
        "eta0_decoupled_ppo_s1": ({0: 0.3, 10: 0.5, 20: 0.8, 30: 0.9}, 0.0),
        "eta4_decoupled_ppo_s0": ({0: 0.3, 10: 0.4, 20: 0.5}, 3.9),
        "eta4_decoupled_ppo_s1": ({0: 0.3, 10: 0.4, 20: 0.7, 30: 0.8}, 3.9),
        "eta4_ppo_s0": ({0: 0.3, 10: 0.2, 20: 0.3, 30: 0.3}, 3.9),
    }
    for name, (accs, stale) in cells.items():
        os.makedirs(tmp_path / name)
        (tmp_path / name / "summary.json").write_text(json.dumps(_summary(accs, stale)))
    cmd = [sys.executable, TOOL, "--out", str(tmp_path), "--etas", "0,4", "--losses", "decoupled_ppo,ppo",
           "--seeds", "0,1", "--report-only"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert "eta4_ppo_s1: no summary.json" in res.stderr  # the missing cell is named
    assert "eta0_ppo" not in res.stderr  # never run: the same objective as decoupled_ppo at eta 0
    report = json.loads((tmp_path / "eta_sweep.json").read_text())
    assert report["common_eval_step"] == 20
    rows = {(r["eta"], r["loss"]): r for r in report["settings"]}
    assert set(rows) == {(0, "decoupled_ppo"), (4, "decoupled_ppo"), (4, "ppo")}
    assert abs(rows[(0, "decoupled_ppo")]["accuracy_at_common"] - 0.7) < 1e-9  # mean of 0.6, 0.8
    assert abs(rows[(4, "decoupled_ppo")]["accuracy_at_common"] - 0.6) < 1e-9
    assert abs(rows[(4, "decoupled_ppo")]["best_accuracy"] - 0.65) < 1e-9  # mean of 0.5, 0.8
    assert rows[(4, "ppo")]["seeds"] == 1 and rows[(4, "decoupled_ppo")]["head_staleness_mean"] == 3.9
    assert (tmp_path / "eta_sweep.png").stat().st_size > 10_000
    assert "| 4 | ppo | 0.300 (0.300) |" in res.stdout
