"""The chaos suite's short form (tools/chaos.py): a stranger attacking the hub of a real 2-process run, a
hung (SIGSTOPped) sampler process, a reward worker killed while it grades, a checkpoint write that fails."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("scenario", ["hostile", "hang", "reward", "disk"])
def test_chaos_short_form(tmp_path, scenario):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, os.path.join(REPO, "tools", "chaos.py"), f"--scenario={scenario}",
           f"--workdir={tmp_path}", f"--out={out}", "--timeout-s=400"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    (result,) = json.loads(out.read_text())
    assert result["ok"] and result["scenario"] == scenario
    if scenario == "hostile":
        assert not result["unpickled"] and result["rejected_counted"] >= result["frames_sent"] >= 9
    elif scenario == "hang":
        assert result["lead_ended_after_s"] <= result["limit_s"] and result["names_process_1"]
    elif scenario == "reward":
        assert result["steps"] == 4 and result["scored_0_worker_died"] >= 1
    else:
        assert result["save"][0].startswith("save2=failed") and result["restore"][-1] == "steps [1, 2]"
