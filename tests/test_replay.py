"""Replay (runtime/replay.py): an asynchronous run (η = 2, in-flight keep_kv updates, dynamic sampling) and
its replay in one process end with the same parameters, bit for bit, at every version; a replay with
another learning rate names the first version that differs. So do a run with two actors in processes of
their own, a resumed run's second segment (from its checkpoint to a later version), and a multi-turn run
whose tool answers at random times with random digits (a changed answer in the record is named). Each
run is a process of its own (launch/run.py, launch/local_cluster.py)."""

import collections
import json
import os
import signal
import subprocess
import sys

from jaxrl_async.runtime.schedule_log import read_schedule, schedule_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6

CONFIG = """
from configs import tiny_arith


def get_config():
    c = tiny_arith.get_config()
    c.total_steps, c.prompts_per_step, c.samples_per_prompt = 6, 4, 4
    c.mode, c.max_staleness = "async", 2
    c.eval_every, c.eval_prompts = 0, 8
    c.checkpoint_every = 0
    c.data.num_train, c.data.num_epochs = 48, 1
    c.sampler.num_slots = 8
    c.sampler.update_mode = "keep_kv"
    c.trainer.token_budget, c.trainer.rows_per_micro = 64, 2
    c.trainer.warmup_steps = 0  # the first step moves the weights (a warmup's lr 0 would not)
    c.warm_start.enabled = False
    c.reward.reward = "format"
    c.reward.defaults = {"format_regex": "[0-9]"}
    return c
"""


def _run(workdir, *flags) -> subprocess.CompletedProcess:
    path = os.path.join(workdir, "config.py")
    if not os.path.exists(path):
        os.makedirs(workdir, exist_ok=True)
        with open(path, "w") as f:
            f.write(CONFIG)
    cmd = [sys.executable, os.path.join(REPO, "launch", "run.py"), f"--config={path}",
           f"--config.workdir={workdir}", *flags]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=900)


def _report(workdir) -> dict:
    with open(os.path.join(workdir, "replay", "report.json")) as f:
        return json.load(f)


def test_async_run_and_its_replay_agree_bit_for_bit(tmp_path):
    """With dynamic sampling: the groups it drops are decisions the replay must make again."""
    dapo = "--config.trainer.dynamic_sampling=True"
    run = _run(tmp_path, dapo)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    actor = read_schedule(schedule_path(str(tmp_path), "actor:0")).records
    learner = read_schedule(schedule_path(str(tmp_path), "learner")).records
    assert [r["t"] for r in learner if "t" in r] == list(range(1, STEPS + 1))
    applied = [a for r in actor for a in r.get("apply", ())]
    # The run was asynchronous: versions were applied while sequences were decoding (keep_kv, in flight),
    # and some step trained groups admitted before the previous version existed.
    assert any(mode == "keep_kv" and live > 0 for _, mode, live in applied), applied
    with open(os.path.join(tmp_path, "summary.json")) as f:
        assert json.load(f)["filtered_groups"] > 0  # dynamic sampling dropped groups (all rewards equal)
    fps = [r["fp"] for r in learner]
    assert len(set(fps)) == len(fps)  # every step moved the weights: the check below can fail

    same = _run(tmp_path, dapo, f"--replay={tmp_path}")
    assert same.returncode == 0, same.stdout[-3000:] + same.stderr[-3000:]
    report = _report(tmp_path)
    assert report["identical"] and report["steps"] == STEPS, report
    assert sorted(map(int, report["versions"])) == list(range(STEPS + 1))
    for v, pair in report["versions"].items():
        assert pair["run"] == pair["replay"] is not None, (v, pair)
    assert report["first_differing_completion"] is None

    # Another learning rate: the replay follows the same schedule until the weights part, and says where.
    other = _run(tmp_path, dapo, f"--replay={tmp_path}", "--config.trainer.lr=1e-3", "--replay_to=2")
    assert other.returncode == 1, other.stdout[-3000:] + other.stderr[-3000:]
    report = _report(tmp_path)
    assert report["first_divergent_version"] == 1 and not report["identical"], report
    assert report["versions"]["0"]["run"] == report["versions"]["0"]["replay"]
    assert report["steps"] <= 2


def test_a_three_process_run_with_two_actors_replays_in_one_process(tmp_path):
    """The learner lead (process 0) and two actors (processes 1 and 2, a sampler replica each) each record
    their own decisions; the replay, in one process, runs both actors' calls side by side and ends with
    the same parameters at every version."""
    # One epoch of exactly STEPS batches: every group admitted trains (which actor decodes which group is
    # timing's decision; that all of them train is not), so both actors' groups are in the record.
    epoch = CONFIG.replace("c.data.num_train, c.data.num_epochs = 48, 1",
                           f"c.data.num_train, c.data.num_epochs = {STEPS * 4}, 1")
    assert epoch != CONFIG
    with open(tmp_path / "config.py", "w") as f:
        f.write(epoch)
    flags = [f"--config={tmp_path / 'config.py'}", f"--config.workdir={tmp_path}",
             "--config.mesh.sampler_processes=(1, 2)", "--config.mesh.trainer_processes=(0,)"]  # fmt: skip
    cmd = [sys.executable, os.path.join(REPO, "launch", "local_cluster.py"), "--num-processes", "3",
           "--devices-per-process", "1", "--heartbeat-timeout-s", "10", "--", *flags]  # fmt: skip
    run = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=REPO), text=True, capture_output=True,
                         timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    assert "process 1 of 3: sampler 0" in run.stdout and "process 2 of 3: sampler 1" in run.stdout
    learner = read_schedule(schedule_path(str(tmp_path), "learner")).records
    assert [r["t"] for r in learner if "t" in r] == list(range(1, STEPS + 1))
    # Both actors decoded groups, and every admitted group trained (so the replay has to interleave them).
    admitted = [{gid for r in read_schedule(schedule_path(str(tmp_path), f"actor:{i}")).records
                 for gid, _ in r.get("add", ())} for i in (0, 1)]  # fmt: skip
    trained = {g for r in learner if "t" in r for g in r["g"]}
    assert admitted[0] and admitted[1] and trained == admitted[0] | admitted[1], (admitted, trained)
    replay = _run(tmp_path, f"--replay={tmp_path}")
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
    report = _report(tmp_path)
    assert report["identical"] and report["steps"] == STEPS, report
    assert all(p["run"] == p["replay"] is not None for p in report["versions"].values())


def test_a_replay_from_the_checkpoint_a_run_resumed_at_matches_it(tmp_path):
    """Killed after step 3 and resumed: the record holds two segments; the second replays from the
    checkpoint it started at (mid-run) to a later version, STEPS - 1, with the run's parameters at every
    version from one to the other."""
    flags = ["--config.checkpoint_every=1", "--config.checkpoint_keep=20"]
    with open(tmp_path / "config.py", "w") as f:
        f.write(CONFIG)
    cmd = [sys.executable, os.path.join(REPO, "launch", "run.py"), f"--config={tmp_path / 'config.py'}",
           f"--config.workdir={tmp_path}", *flags]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for line in proc.stdout:
        if "step 3 |" in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL
    resumed = _run(tmp_path, *flags)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout + resumed.stderr
    learner = read_schedule(schedule_path(str(tmp_path), "learner")).records
    starts = [r["version"] for r in learner if "start" in r]
    assert len(starts) == 2 and starts[0] == 0 and 1 <= starts[1] <= 3, starts
    start = starts[1]

    to = STEPS - 1
    replay = _run(tmp_path, f"--replay={tmp_path}", f"--replay_from={start}", f"--replay_to={to}", *flags)
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
    report = _report(tmp_path)
    assert report["identical"] and report["steps"] == to - start and report["restarts"] == 1, report
    assert sorted(map(int, report["versions"])) == list(range(start, to + 1))
    assert all(p["run"] == p["replay"] is not None for p in report["versions"].values())


# Multi-turn episodes whose tool answers after a random delay with a random digit appended
# (tests/multiturn_envs.py): the record holds each answer and the decode call it landed after.
EPISODES_CONFIG = """
import sys

sys.path.insert(0, {tests!r})
sys.path.insert(0, {repo!r})
from test_multiturn_run import _config


def get_config():
    c = _config("", tool="jittery_calculator", mode="async", total_steps={steps}, eval_every=0)
    c.sampler.update_mode = "recompute_kv"  # parked episodes' caches are rebuilt under each new version
    c.checkpoint_every = 0
    c.trainer.warmup_steps = 0  # the first step moves the weights too
    return c
"""
EPISODE_STEPS = 2


def test_an_async_run_with_a_nondeterministic_tool_replays_and_a_changed_answer_is_named(tmp_path):
    from jaxrl_async.runtime.schedule_log import encode

    tests = os.path.join(REPO, "tests")
    (tmp_path / "config.py").write_text(EPISODES_CONFIG.format(tests=tests, repo=REPO, steps=EPISODE_STEPS))
    run = _run(tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    path = schedule_path(str(tmp_path), "actor:0")
    actor = read_schedule(path).records
    answers = [a for r in actor if "o" in r for a in r["o"]]
    observations = collections.defaultdict(set)  # group -> its samples' tool observations
    for gid, _, _, obs, _, *reason in answers:
        if not reason:
            observations[gid].add(tuple(obs))
    # The tool was not deterministic: the samples of one prompt got different answers to the same sum.
    assert any(len(o) > 1 for o in observations.values()), observations
    learner = read_schedule(schedule_path(str(tmp_path), "learner")).records
    fps = [r["fp"] for r in learner]
    assert len(set(fps)) == len(fps) == EPISODE_STEPS + 1  # every step moved the weights

    same = _run(tmp_path, f"--replay={tmp_path}")
    assert same.returncode == 0, same.stdout[-3000:] + same.stderr[-3000:]
    report = _report(tmp_path)
    assert report["identical"] and report["steps"] == EPISODE_STEPS, report
    assert sorted(map(int, report["versions"])) == list(range(EPISODE_STEPS + 1))
    assert all(p["run"] == p["replay"] is not None for p in report["versions"].values())

    # Another answer from the tool, in a trained group whose rewards differ (its samples move the weights):
    # the replay feeds it and names that episode, and where the parameters (or the schedule) part.
    trained = {g: r["t"] for r in learner if "t" in r for g in r["g"]}  # group -> the version it made
    rewards = collections.defaultdict(set)
    for r in actor:
        for gid, _, reward, *_ in r.get("r", ()):
            rewards[gid].add(reward)
    ended = {(a[0], a[1]) for a in answers if a[5:] == ["answer"]}
    target = next((a for a in answers if len(a) == 5 and a[0] in trained and len(rewards[a[0]]) > 1
                   and (a[0], a[1]) in ended), None)  # fmt: skip
    assert target is not None, answers
    obs = target[3]
    i = next(i for i in range(len(obs) - 1) if obs[i] != obs[i + 1])
    obs[i] = obs[i + 1]
    lines = [encode(r) for r in actor]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    other = _run(tmp_path, f"--replay={tmp_path}", f"--replay_to={trained[target[0]]}")
    assert other.returncode == 1, other.stdout[-3000:] + other.stderr[-3000:]
    report = _report(tmp_path)
    assert not report["identical"], report
    first = report["first_differing_completion"]
    assert first is not None and (first["group"], first["sample"]) == (target[0], target[1]), report
    assert report["first_divergent_version"] is not None or report["schedule_broken"], report
    assert report["steps"] <= trained[target[0]]
