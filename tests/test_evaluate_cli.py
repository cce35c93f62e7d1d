"""jaxrl-evaluate scores a run's saved versions as the run itself scored them (same prompts, weights,
greedy engine and reward)."""

import json
import os
import subprocess
import sys
import tempfile

import pytest

from jaxrl_async.runtime.metrics import read_scalars

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# letter_range's weighted held-out set on a random model; the format reward gives it some right answers.
CONFIG = """
from configs import letter_range


def get_config():
    c = letter_range.get_config()
    c.total_steps, c.prompts_per_step, c.samples_per_prompt = 2, 4, 4
    c.eval_every, c.eval_prompts, c.checkpoint_every = 1, 24, 1
    c.sampler.num_slots, c.sampler.max_new_tokens = 8, 8
    c.trainer.token_budget, c.trainer.rows_per_micro = 24, 4
    c.warm_start.enabled = False
    c.reward.reward = "format"
    c.reward.defaults = {"format_regex": "^[a-m]"}
    return c
"""


def _python(*args, timeout=600):
    return _pythons(args, timeout=timeout)[0]


def _pythons(*commands, timeout=600) -> list[tuple[int, str]]:
    """Runs the commands (each `python ARGS...`) side by side; (exit status, stdout + stderr) of each. They
    read a finished run and write files of their own, so they need not wait for each other."""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in commands]
    procs = [subprocess.Popen([sys.executable, *args], env=env, text=True, stdout=out, stderr=err)
             for args, (out, err) in zip(commands, files, strict=True)]  # fmt: skip
    try:
        results = []
        for p, (out, err) in zip(procs, files, strict=True):
            p.wait(timeout=timeout)
            out.seek(0), err.seek(0)
            results.append((p.returncode, out.read() + err.read()))
        return results
    finally:
        for p, (out, err) in zip(procs, files, strict=True):
            if p.poll() is None:
                p.kill()
                p.wait()
            out.close(), err.close()


def test_evaluate_gives_the_accuracies_the_run_logged(tmp_path):
    config = tmp_path / "config.py"
    config.write_text(CONFIG)
    work = tmp_path / "run"
    run_py, evaluate = os.path.join(REPO, "launch", "run.py"), ("-m", "jaxrl_async.cli.evaluate")
    rc, out = _python(run_py, f"--config={config}", f"--config.workdir={work}")
    assert rc == 0, out[-3000:]
    logged = dict(read_scalars(str(work / "tb"))["eval/accuracy"])
    assert {1, 2} <= set(logged) and any(0 < a < 1 for a in logged.values()), logged  # not 0 == 0
    # The evaluations of the finished run, side by side (each a process of its own, reading the run).
    report, train, expected = tmp_path / "eval.json", tmp_path / "train.json", tmp_path / "expected.json"
    common = (*evaluate, f"--config={config}", f"--checkpoint={work}")
    held_out, by_length, refused, letter_range, nowhere = _pythons(
        (*common, "--steps=1,2", f"--out={report}"),
        (*common, "--split=train", "--by_length", f"--out={train}"),
        (*common, "--expected_reward"),
        (*common, "--config.reward.reward=letter_range", "--steps=2", "--expected_reward",
         f"--out={expected}"),
        (*evaluate, f"--config={config}", f"--checkpoint={tmp_path / 'nowhere'}"),
    )
    rc, out = held_out
    assert rc == 0, out[-3000:]
    got = {int(v): a for v, a in json.loads(report.read_text()).items()}
    assert got == pytest.approx({v: logged[v] for v in (1, 2)}, abs=1e-6), (got, logged)
    assert "version 2: held-out accuracy" in out and "(24 prompts)" in out
    # The training split, per band of answer length: the bands weigh back to the version's accuracy.
    rc, out = by_length
    assert rc == 0, out[-3000:]
    (version, got), = json.loads(train.read_text()).items()
    assert version == "2" and f"version 2: train-split accuracy {got['accuracy']:.4f} (24 prompts)" in out
    bands = got["by_length"]
    assert len(bands) >= 3 and sum(b["prompts"] for b in bands.values()) == 24
    assert sum(b["weight"] * b["accuracy"] for b in bands.values()) == pytest.approx(got["accuracy"])
    assert all(f"  answer {band} tokens: accuracy" in out for band in bands)
    # The expected reward: refused for a reward that accepts many completions, naming the field; given
    # with its standard error for letter_range's exact-match reward.
    rc, out = refused
    assert rc != 0 and "--expected_reward: config.reward.reward='format'" in out, out[-2000:]
    rc, out = letter_range
    assert rc == 0, out[-3000:]
    got = json.loads(expected.read_text())["2"]
    assert 0 < got["expected_reward"] < 1 and 0 < got["expected_reward_stderr"] < got["expected_reward"]
    assert f"version 2: held-out expected reward {got['expected_reward']:.4f} +- " in out
    rc, out = nowhere
    assert rc != 0 and "--checkpoint" in out and "not a run of ours" in out
