"""The chaos suite's short form (benchmarks/chaos.py): a stranger attacking the hub of a real 2-process run, a
hung (SIGSTOPped) sampler process, a hung trainer follower (3 processes), a reward worker killed while it
grades, checkpoint writes that fail (the checkpoint manager alone, and inside a running run). Random kills
with restarts (seven 3-process runs) is a benchmark command (docs/history/benchmarks.md)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("scenario", ["hostile", "hang", "reward", "disk", "disk-run", "hang-follower"])
def test_chaos_short_form(tmp_path, scenario):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, "-m", "benchmarks.chaos", f"--scenario={scenario}",
           f"--workdir={tmp_path}", f"--out={out}", "--timeout-s=400", "--restart-steps=12"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    (result,) = json.loads(out.read_text())
    assert result["ok"] and result["scenario"] == scenario
    if scenario == "hostile":
        assert not result["unpickled"] and result["rejected_counted"] >= result["frames_sent"] >= 9
    elif scenario == "hang":
        assert result["lead_ended_after_s"] <= result["limit_s"] and result["names_process_1"]
    elif scenario == "hang-follower":  # the lead (0) and the sampler (2) both ended, naming process 1
        assert sorted(result["ended_after_s"]) == ["0", "2"] and max(result["ended_after_s"].values()) <= 40
        assert result["names_process_1"] == {"0": True, "2": True}
    elif scenario == "reward":
        assert result["steps"] == 4 and result["scored_0_worker_died"] >= 1
    elif scenario == "disk-run":  # warned and trained on, saved again, stopped with a message, resumed
        assert len(result["failed_versions"]) == 2 and result["last_good_readable"]
        assert result["exit_status"] == 1 and not result["partial_dirs"]
        assert result["resumed_at"] == result["last_committed"] > result["last_good"]
        assert result["versions_complete"] and result["prompts_lost"] == result["prompts_trained_twice"] == 0
    else:  # background failures warn, a waiting save raises; no partial directory; the next start resumes
        assert result["save"] == [
            "background failures 1",
            "save4=failed, names version 1: True",
            "failures 3 on disk ['1']",
        ]
        assert result["restore"] == ["restored 1 0.0 {'version': 1}", "steps [1, 2]"]
