"""The chaos suite's short form (benchmarks/chaos.py): a stranger attacking the hub of a real 2-process run, a
hung (SIGSTOPped) sampler process, a hung trainer follower (3 processes), a reward worker killed while it
grades, checkpoint writes that fail (the checkpoint manager alone, and inside a running run). Random kills
with restarts (seven 3-process runs) is a benchmark command (docs/history/benchmarks.md).

Each scenario is its own `python -m benchmarks.chaos --scenario=...` command, as before; the scenarios this
session collected start from one module fixture, at most `_AT_ONCE` at a time, and each test checks its own
command's result. Much of a scenario's time is waiting (a SIGSTOPped process's heartbeat timeout, a slow
reward, a restart), which the others fill; the bounds a scenario asserts (a hang ended within the heartbeat
timeout + 30 s) are measured by the tool itself, from the fault to the end, as before. The runs use the
suite's compile cache (--compile-cache-dir), so their sampler processes load their programs too."""

import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIOS = ["hostile", "hang", "reward", "disk", "disk-run", "hang-follower"]
# The longest first (reward, the hang-follower's three processes), so the short ones fill in behind them.
_ORDER = ["reward", "hang-follower", "hang", "disk-run", "hostile", "disk"]
_AT_ONCE = 3


def _command(scenario: str, workdir) -> list[str]:
    out = workdir / "chaos.json"
    # The suite's compile cache (tests/conftest.py), where there is one: the sampler processes load their
    # programs too.
    cache = os.environ.get("JAXRL_TESTS_COMPILE_CACHE_DIR", "")
    return [sys.executable, "-m", "benchmarks.chaos", f"--scenario={scenario}",
            f"--workdir={workdir}", f"--out={out}", "--timeout-s=400", "--restart-steps=8",
            *([f"--compile-cache-dir={cache}"] if cache else [])]  # fmt: skip


@pytest.fixture(scope="module")
def chaos_runs(request, tmp_path_factory) -> dict:
    """scenario -> (exit status, stdout, stderr, workdir) of the chaos command of each scenario this session
    collected, run at most `_AT_ONCE` at a time."""
    wanted = {item.callspec.params["scenario"] for item in request.session.items
              if getattr(item, "originalname", "") == "test_chaos_short_form"}  # fmt: skip
    queue = [s for s in _ORDER if s in wanted]
    env = dict(os.environ, PYTHONPATH=REPO)
    running, done = {}, {}
    deadline = time.monotonic() + 800
    while queue or running:
        while queue and len(running) < _AT_ONCE:
            name = queue.pop(0)
            workdir = tmp_path_factory.mktemp(f"chaos_{name}")
            log = open(workdir / "command.log", "w+")  # noqa: SIM115  (closed below)
            err = open(workdir / "command.err", "w+")  # noqa: SIM115
            proc = subprocess.Popen(_command(name, workdir), env=env, text=True, stdout=log, stderr=err)
            running[name] = (proc, log, err, workdir)
        for name, (proc, log, err, workdir) in list(running.items()):
            if proc.poll() is None and time.monotonic() < deadline:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.seek(0), err.seek(0)
            done[name] = (proc.returncode, log.read(), err.read(), workdir)
            log.close(), err.close()
            del running[name]
        time.sleep(0.2)
    return done


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_chaos_short_form(chaos_runs, scenario):
    returncode, stdout, stderr, workdir = chaos_runs[scenario]
    assert returncode == 0, stdout[-4000:] + stderr[-2000:]
    (result,) = json.loads((workdir / "chaos.json").read_text())
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
