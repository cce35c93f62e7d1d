"""Multi-turn episodes inside a run (config.env): sync and async runs train episodes with their
observations masked and log env/ tags; evaluation runs greedy episodes; a killed run restarts the episodes
it had in flight exactly once; a bad env field fails before anything compiles, naming the field.

The runs name `multiturn_envs:first_turn_calls` (tests/multiturn_envs.py): a random tiny model never writes
a tool call itself, so each episode's first turn is taken as a calculator call.
"""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from configs import tiny_arith
from jaxrl_async.run_config import ConfigError, validate
from jaxrl_async.runtime.metrics import ENV_TAGS, read_scalars
from jaxrl_async.runtime.orchestrator import run_from_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")


def _config(workdir, tool="calculator", **overrides):
    c = tiny_arith.get_config()
    c.workdir = str(workdir)
    c.total_steps, c.prompts_per_step, c.samples_per_prompt = 2, 4, 4
    c.eval_every, c.eval_prompts, c.max_staleness = 0, 4, 1
    c.mesh.sampler, c.mesh.trainer = (1, 1), (1, 1)
    c.warm_start.enabled = False
    c.reward.reward = "format"  # the answer turn holds a digit (~50%): every group has signal
    c.reward.defaults = {"format_regex": "[0-9]"}
    c.sampler.num_slots = 8
    # A slot holds the prompt (8) and the episode: a turn (6), "<result>136</result>" (20), a turn (6).
    c.sampler.token_budget = 8 * 48
    c.trainer.token_budget, c.trainer.rows_per_micro = 64, 2
    c.env.enabled = True
    c.env.environment = "multiturn_envs:first_turn_calls"
    c.env.tools = (tool,)
    c.env.max_turns = 2
    c.env.max_observation_tokens = 24
    c.env.max_episode_tokens = 40
    c.update_from_flattened_dict(overrides)  # "section.field" keys, type-checked as a flag would be
    return c


ANSWER_REWARD = """
import time


def grade(prompt, completion, metadata):
    if completion == "boom":
        raise RuntimeError("boom")
    if completion == "hang":
        time.sleep(600)
    return 1.0
"""


def test_a_reward_that_raises_or_hangs_on_an_episode_answer_scores_0(tmp_path, monkeypatch):
    """The actor's grading of episodes (GroupAssembly.submit_episodes and the reward service): answer turns
    whose reward raises or hangs score 0 with their reason, the group still goes to the learner with every
    episode's mask, and the service grades on. The time-out runs on a clock the test advances."""
    from jaxrl_async.data.prompt import Prompt
    from jaxrl_async.envs.episode import Episode
    from jaxrl_async.rewards import RewardConfig
    from jaxrl_async.rewards.service import RewardService
    from jaxrl_async.runtime.rollout_groups import GroupAssembly
    from jaxrl_async.tokenizer import CharTokenizer

    (tmp_path / "episode_rewards_q55.py").write_text(ANSWER_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned workers inherit sys.path
    tok, now = CharTokenizer(), [0.0]
    cfg = RewardConfig(reward="episode_rewards_q55:grade", num_workers=2, timeout_s=1.0,
                       imports=("episode_rewards_q55",))  # fmt: skip
    prompt = Prompt("p0", "1+2=", np.asarray(tok.encode("1+2="), np.int32), "3", {"answer": "3", "task": "t"})
    with RewardService(cfg, clock=lambda: now[0]) as svc:
        svc.wait_ready()
        groups = GroupAssembly(3, cfg, 16, svc, tok)
        finished = []
        for i, answer in enumerate(["3", "boom", "hang"]):
            e = Episode(np.asarray(prompt.tokens), uid=5, sample_index=i)
            call, text = tok.encode("<tool>1+2</tool>"), tok.encode(answer)
            e.add_turn(call, [0.0] * len(call), [0] * len(call))
            e.add_observation(tok.encode("<result>3</result>"))
            e.add_turn(text, [0.0] * len(text), [0] * len(text))
            e.finish_reason = "answer"
            finished.append((e, prompt))
        groups.submit_episodes(finished)
        results, deadline = [], time.monotonic() + 120  # a guard against a hang, not a timing
        while len(results) < 2:  # the clock stands still: only the hanging call is left in flight
            assert time.monotonic() < deadline, results
            svc.wait(0.5)
            results += svc.poll()
        now[0] += cfg.timeout_s + 0.5
        while len(results) < 3:
            assert time.monotonic() < deadline, results
            svc.wait(0.5)
            results += svc.poll()
        for r in results:
            groups.add(r)
        (group,) = groups.take_ready()
        assert [(r.reward, r.metadata["reason"]) for r in group] == [
            (1.0, "ok"), (0.0, "error:RuntimeError"), (0.0, "timeout")]  # fmt: skip
        for r, (e, _) in zip(group, finished, strict=True):
            assert list(r.model_mask) == e.model_mask and r.finish_reason == "answer"
        assert svc.grade_batch([("1+2=", "3", {"answer": "3"})], timeout=60) == [1.0]  # it grades on


# In-flight weight updates keep their modes: async runs swap versions while episodes are parked (recompute_kv
# rebuilds their caches, observations included; finish lets running turns end and not parked episodes).
MODES = [("sync", "keep_kv"), ("async", "recompute_kv"), ("async", "finish")]


@pytest.mark.parametrize("mode, update_mode", MODES)
def test_a_run_trains_episodes_with_observations_masked_and_logs_env_tags(tmp_path, mode, update_mode,
                                                                          monkeypatch):  # fmt: skip
    monkeypatch.syspath_prepend(TESTS)
    from jaxrl_async.runtime import rollout_groups

    trained = []  # every rollout the actor assembled (the learner trains these groups)
    complete = rollout_groups.GroupAssembly._complete
    monkeypatch.setattr(rollout_groups.GroupAssembly, "_complete",
                        lambda self, r: (trained.append(r), complete(self, r))[1])  # fmt: skip
    summary = run_from_config(_config(tmp_path, mode=mode, **{"sampler.update_mode": update_mode}))
    assert summary["steps"] == 2
    assert [e["step"] for e in summary["evals"]] == [0, 2]  # greedy episodes held out
    # Every sample was an episode: a model turn, the calculator's answer (masked), a model turn.
    assert len(trained) >= 2 * 4 * 4
    for r in trained:
        mask = np.asarray(r.model_mask)
        assert mask.shape == r.completion_tokens.shape and mask[0]
        observation = r.completion_tokens[~mask]
        assert 0 < len(observation) <= 24 and (r.versions[~mask] == -1).all()
        assert (r.behav_logprobs[~mask] == 0).all() and (r.versions[mask] >= 0).all()
        assert r.metadata["turns"] == 2 and r.finish_reason in ("answer", "max_turns", "capacity")
        assert "<result>" in r.metadata["text"]  # the text sample shows the whole episode
    for r in trained:  # the observation is the calculator's true answer to the prompt's sum
        a, b = r.metadata["prompt"].rstrip("=").split("+")
        assert f"<result>{int(a) + int(b)}</result>" in r.metadata["text"]
    tags = read_scalars(str(tmp_path / "tb"))
    assert [t for t in ENV_TAGS if t not in tags] == []
    assert tags["env/turns_per_episode"][-1][1] == 2.0
    assert 0.2 < tags["env/observation_token_fraction"][-1][1] < 0.9
    assert tags["env/tool_calls"][-1][1] >= 2 * 4 * 4 and tags["env/tool_errors"][-1][1] == 0
    assert tags["env/tool_latency_ms_mean"][-1][1] > 0
    assert 0 < tags["env/parked_slot_fraction"][-1][1] < 1


def test_bad_env_fields_fail_before_anything_compiles_naming_the_field(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(TESTS)
    cases = {
        r"config\.env\.tools: \['nope'\] not registered": {"env.tools": ("nope",)},
        r"config\.env\.max_episode_tokens=400: .* exceed the 48 tokens": {"env.max_episode_tokens": 400},
        r"config\.env\.max_turns must be an integer >= 1": {"env.max_turns": 0},
        r"config\.env\.environment=.*cannot import 'no_such_module'": {"env.environment": "no_such_module:f"},
        r"config\.env\.tool_format=": {"env.tool_format": "xml"},
        r"config\.env\.step_timeout_s=5\.0 .* config\.env\.tool_timeout_s": {"env.step_timeout_s": 5.0},
        r"config\.sampler\.attention='cpu_kernel': multi-turn": {"sampler.attention": "cpu_kernel"},
        r"config\.reward\.overlong_buffer": {"reward.overlong_buffer": 2},
        r"config\.trainer\.token_budget=40: .*config\.env\.max_episode_tokens": {"trainer.token_budget": 40},
        r"config\.env\.environment: has no effect with config\.env\.enabled=False": {"env.enabled": False},
    }
    for pattern, over in cases.items():
        with pytest.raises(ConfigError, match=pattern):
            validate(_config(tmp_path / "w", **over))
    with pytest.raises(ConfigError, match=r"config\.env\.tools"):  # the run refuses it before building
        run_from_config(_config(tmp_path / "w", **{"env.tools": ("nope",)}))
    assert not (tmp_path / "w").exists()  # nothing was built
    run = validate(_config(tmp_path / "w", mode="async"))  # the tests' own config is valid
    assert run.record_schedule  # "auto" records an async multi-turn run (its tools' answers too)


# One epoch of 32 prompts = 8 steps of 4, a checkpoint after every step; a 50 ms tool keeps episodes
# parked, so a kill finds some in flight.
RESUME_CONFIG = """
import sys

sys.path.insert(0, {tests!r})
sys.path.insert(0, {repo!r})
from test_multiturn_run import _config


def get_config():
    c = _config("", tool="slow_calculator", total_steps=8, eval_every=0, eval_prompts=4)
    c.checkpoint_every = 1
    c.data.num_train, c.data.num_epochs = 32, 1
    return c
"""


def _start(workdir):
    path = os.path.join(workdir, "config.py")
    if not os.path.exists(path):
        os.makedirs(workdir, exist_ok=True)
        with open(path, "w") as f:
            f.write(RESUME_CONFIG.format(tests=TESTS, repo=REPO))
    cmd = [sys.executable, os.path.join(REPO, "launch", "run.py"), f"--config={path}"]
    cmd.append(f"--config.workdir={workdir}")
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{TESTS}", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _run_until(proc, step, timeout=300):
    lines, deadline = [], time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        if step is not None and f"step {step} |" in line:
            proc.send_signal(signal.SIGKILL)
            break
        assert time.monotonic() < deadline, "".join(lines[-30:])
    return "".join(lines) + proc.communicate(timeout=timeout)[0]


def test_a_resumed_run_restarts_the_episodes_in_flight_exactly_once(tmp_path):
    import json

    proc = _start(tmp_path)
    out = _run_until(proc, 3)
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    proc = _start(tmp_path)
    out = _run_until(proc, None)
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in out
    started_again = re.search(r"resume: (\d+) prompts in flight at the checkpoint are started again", out)
    assert started_again and int(started_again.group(1)) > 0, out[-3000:]  # episodes were in flight
    last = {}
    with open(tmp_path / "trained_uids.jsonl") as f:
        for line in f:
            row = json.loads(line)
            last[row["version"]] = row["uids"]  # after a resume a version's last line counts
    assert sorted(last) == list(range(1, 9))
    uids = [u for v in sorted(last) for u in last[v]]
    # Each prompt trained once: those whose episodes were parked or graded at the kill were started again,
    # whole, by the resumed run, and none twice.
    assert sorted(uids) == sorted(f"0:{r}" for r in range(32))
    tags = read_scalars(str(tmp_path / "tb"))
    assert tags["env/tool_calls"][-1][1] > 0 and tags["env/turns_per_episode"][-1][1] == 2.0


def test_every_env_tag_is_documented():
    with open(os.path.join(REPO, "docs", "environments.md")) as f:
        text = f.read()
    assert [tag for tag in ENV_TAGS if f"`{tag}`" not in text] == []


TWO_PROCESS_CONFIG = """
import sys

sys.path.insert(0, {tests!r})
sys.path.insert(0, {repo!r})
from test_multiturn_run import _config


def get_config():
    return _config("", eval_every=0, eval_prompts=4)
"""


def test_a_replica_that_spans_processes_runs_episodes_as_one_process(tmp_path):
    """A (2, 2) sampler replica over processes 1 and 2 (2 CPU devices each) and a trainer process, sync and
    greedy, evaluating versions 0 and 2 while it samples: the member makes the leader's queueing, resumes
    (`Engine.extend` on the mesh) and finishes of both loops at the same points (`replica.MirroredLoop`),
    so it decodes what the leader does, and the episodes, their evaluations and the losses are those of
    the same meshes in one process. It is also the multi-process run with tools: the learner on process 0,
    the actor and its tools on processes 1-2, episodes, their masks and the actor's env counters crossing
    the wire."""
    import json

    from tests.test_multiprocess import _beside_one_process, _launch, _texts

    path = tmp_path / "config.py"
    path.write_text(TWO_PROCESS_CONFIG.format(tests=TESTS, repo=REPO))
    common = {"mesh.sampler": "(2,2)", "mesh.trainer": "(2,1)", "mode": "sync", "sampler.temperature": 0.0,
              "text_samples": 16, "eval_every": 2}  # fmt: skip
    if os.environ.get("JAXRL_TESTS_COMPILE_CACHE_DIR"):  # the suite's compile cache (tests/conftest.py)
        common["compile_cache_dir"] = os.environ["JAXRL_TESTS_COMPILE_CACHE_DIR"]
    flags = lambda name, **more: [f"--config={path}", f"--config.workdir={tmp_path / name}"] + [  # noqa: E731
        f"--config.{k}={v}" for k, v in {**common, **more}.items()
    ]
    (tmp_path / "single").mkdir()
    single = flags("single", **{"mesh.fake_cpu_devices": 6})
    res, one = _beside_one_process(lambda: _launch(3, 2, flags("multi")), single, tmp_path / "single")
    assert res.returncode == 0, res.stdout[-4000:]
    assert "process 2 of 3: sampler 0 member 1" in res.stdout
    assert one.returncode == 0, one.stderr[-4000:]
    summaries = {}
    for name in ("multi", "single"):
        with open(tmp_path / name / "summary.json") as f:
            summaries[name] = json.load(f)
    (rec,) = summaries["multi"]["replicas"].values()
    (member,) = rec["members"].values()
    assert member["tokens_generated"] == rec["tokens_generated"] > 0
    assert member["applied_at"] == rec["applied_at"]
    evals = {k: [(e["step"], e["accuracy"]) for e in s["evals"]] for k, s in summaries.items()}
    assert [step for step, _ in evals["multi"]] == [0, 2] and evals["multi"] == evals["single"]
    texts = {k: _texts(tmp_path / k / "tb") for k in ("multi", "single")}
    assert sorted(texts["multi"]) == [1, 2] and texts["multi"] == texts["single"]
    assert all("<result>" in t for ts in texts["multi"].values() for t in ts)  # whole episodes
    scalars = {k: read_scalars(str(tmp_path / k / "tb")) for k in ("multi", "single")}
    tags = scalars["multi"]
    assert tags["env/tool_calls"][-1][1] >= 2 * 4 * 4
    assert tags["env/turns_per_episode"][-1][1] == 2.0 and tags["env/observation_token_fraction"][-1][1] > 0.2
    loss = {k: [v for _, v in s["loss/policy"]] for k, s in scalars.items()}
    assert loss["multi"] == pytest.approx(loss["single"], abs=1e-5)
