"""Multi-turn episodes on the sampler: a parked slot keeps its KV cache, an observation is appended by a
prefill on top of it (`Engine.extend`), and what the slot then samples equals a fresh prefill of the whole
context, on the slotted and the paged caches; other slots decode meanwhile; a recompute_kv update that
lands mid-episode rebuilds the observation's keys and values too."""

import threading

import numpy as np
import pytest
from test_sampler import MESH1, TINY, _by_uid, _params, _prompts

from jaxrl_async.sampler import Engine, Request, SamplerConfig, SamplerLoop

OBS = [7, 8, 9, 10, 11]


def _engine(params, attention):
    kw = dict(num_slots=4, max_prompt_len=32, max_new_tokens=8, steps_per_call=2, temperature=1.0)
    if attention == "paged_kernel":
        kw.update(page_size=4)
    return Engine(TINY, params, MESH1, SamplerConfig(attention=attention, linear="xla", **kw))


@pytest.fixture(scope="module")
def params():
    return _params()


@pytest.mark.parametrize("attention", ["xla", "paged_kernel"])
def test_an_extended_slot_samples_what_a_fresh_prefill_of_the_whole_context_does(params, attention):
    engine = _engine(params, attention)
    prompt, other = _prompts(2, seed=11, lo=4, hi=8)
    loop = SamplerLoop(engine)
    loop.add_request(Request("a", prompt, seed=3, max_new_tokens=4, park=True))
    loop.add_request(Request("other", other, seed=5))
    first = _by_uid(loop.run())
    turn1 = first[("a", 0)]
    assert turn1.parked and len(turn1.tokens) == 4 and loop.parked == [("a", 0)]
    assert loop.stats.parked_slot_steps > 0  # "other" decoded while "a" waited, its slot held
    calls = loop.stats.calls
    loop.step()
    assert loop.stats.calls == calls  # only a parked slot left: nothing is dispatched

    loop.resume("a", 0, OBS, max_new_tokens=8)
    turn2 = _by_uid(loop.run())[("a", 0)]
    assert turn2.parked and len(turn2.tokens) == 8
    loop.finish("a", 0)
    assert loop.idle and not loop.parked and loop.free_slots == 4
    assert loop.stats.extensions == 1 and loop.stats.extension_tokens == len(OBS)

    fresh = SamplerLoop(engine)
    context = [*prompt, *turn1.tokens.tolist(), *OBS]
    fresh.add_request(Request("b", context, seed=3, max_new_tokens=8))
    ref = _by_uid(fresh.run())[("b", 0)]
    assert turn2.tokens.tolist() == ref.tokens.tolist()  # temperature 1: the same draws from the same logits
    np.testing.assert_allclose(turn2.logprobs, ref.logprobs, atol=1e-5)

    alone = SamplerLoop(engine)
    alone.add_request(Request("other", other, seed=5))
    assert _by_uid(alone.run())[("other", 0)].tokens.tolist() == first[("other", 0)].tokens.tolist()
    if attention == "paged_kernel":
        table = loop.planner.table
        assert all(table.num_free(d) == table.capacity for d in range(table.shards))


def test_recompute_kv_mid_episode_rebuilds_the_observation_and_stamps_versions(params):
    new = _params(seed=1)
    engine = _engine(params, "xla")
    prompt = _prompts(1, seed=12, lo=4, hi=8)[0]
    loop = SamplerLoop(engine)
    loop.add_request(Request("a", prompt, seed=3, max_new_tokens=4, park=True))
    turn1 = _by_uid(loop.run())[("a", 0)]
    loop.resume("a", 0, OBS, max_new_tokens=8)
    loop.step(), loop.step()
    loop.update_params(new, version=1, mode="recompute_kv")
    turn2 = _by_uid(loop.run())[("a", 0)]
    n_old = int(np.sum(turn2.versions == 0))
    assert 0 < n_old < 8 and turn2.versions.tolist() == [0] * n_old + [1] * (8 - n_old)
    assert set(turn1.versions.tolist()) == {0}

    fresh = SamplerLoop(engine)  # the same engine holds the new weights now
    context = [*prompt, *turn1.tokens.tolist(), *OBS, *turn2.tokens[:n_old].tolist()]
    fresh.add_request(Request("b", context, seed=3, max_new_tokens=8 - n_old))
    ref = _by_uid(fresh.run())[("b", 0)]
    assert ref.tokens.tolist() == turn2.tokens[n_old:].tolist()
    np.testing.assert_allclose(ref.logprobs, turn2.logprobs[n_old:], atol=1e-5)


def test_updates_between_turns_stamp_the_next_turn_and_resume_refuses_what_cannot_fit(params):
    engine = _engine(params, "xla")
    loop = SamplerLoop(engine)
    loop.add_request(Request("a", [1, 2, 3], max_new_tokens=4, park=True))
    assert set(loop.run()[0].versions.tolist()) == {0}
    loop.update_params(_params(seed=1), version=2, mode="finish")  # a parked turn does not hold it back
    loop.step()
    assert loop.engine.version == 2
    loop.update_params(params, version=3, mode="keep_kv")
    loop.resume("a", 0, OBS, max_new_tokens=4)
    assert set(loop.run()[0].versions.tolist()) == {3}
    with pytest.raises(KeyError):
        loop.resume("nope", 0, OBS)
    with pytest.raises(ValueError, match="empty observation"):
        loop.resume("a", 0, [])
    with pytest.raises(ValueError, match="capacity"):
        loop.resume("a", 0, [1] * 40)


class _Scripted:
    """Answers every turn with the same observation (slowly, as a tool would) until the third turn;
    counts how many of its kind answer at once. Row 0's first answer waits until another episode has
    had a second answer, which needs decoding while row 0's slots are parked: the overlap the test
    checks is forced by events, not hoped for from a clock."""

    active = 0
    most = 0
    lock = __import__("threading").Lock()
    others_second_turn = __import__("threading").Event()

    def __init__(self, row):
        self.turns = 0
        self.row = row["row"]

    def step(self, turn):
        import time

        from jaxrl_async.envs import StepResult

        with _Scripted.lock:
            _Scripted.active += 1
            _Scripted.most = max(_Scripted.most, _Scripted.active)
        if self.row == 0 and self.turns == 0:
            assert _Scripted.others_second_turn.wait(timeout=60), "no other episode advanced"
        else:
            time.sleep(0.2)
        with _Scripted.lock:
            _Scripted.active -= 1
        self.turns += 1
        if self.row != 0 and self.turns == 2:
            _Scripted.others_second_turn.set()
        if self.turns == 3:
            return StepResult(None, reward=1.0, done=True, info={"reason": "answer"})
        return StepResult([5, 6, 7], reward=0.0, done=False)


def test_the_episode_driver_runs_episodes_with_environments_off_the_decode_loop(params):
    from jaxrl_async.envs import EnvConfig
    from jaxrl_async.envs.driver import EpisodeDriver
    from jaxrl_async.rollouts import OBSERVATION_VERSION

    engine = _engine(params, "xla")
    loop = SamplerLoop(engine)
    driver = EpisodeDriver(loop, EnvConfig(max_turns=5, max_episode_tokens=64), tokenizer=_Ids(),
                           make_env=_Scripted, workers=4, max_turn_tokens=3)  # fmt: skip
    prompts = _prompts(3, seed=13, lo=3, hi=6)
    for i, p in enumerate(prompts):
        driver.add(i, {"row": i}, p, n_samples=2, seed=i)
    episodes = driver.run()
    assert len(episodes) == 6 and driver.in_flight == 0 and loop.idle and loop.free_slots == 4
    assert _Scripted.most >= 2  # environments answered concurrently, beside decoding
    assert loop.stats.extensions == 12 and loop.stats.parked_slot_steps > 0
    for ep in episodes:
        r = ep.to_rollout(uid=ep.uid, sample_index=ep.sample_index)
        assert r.reward == 1.0 and ep.turns == 3 and ep.finish_reason == "answer"
        assert r.model_mask.tolist() == [True] * 3 + [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
        assert r.completion_tokens[~r.model_mask].tolist() == [5, 6, 7] * 2
        assert set(r.versions[~r.model_mask].tolist()) == {OBSERVATION_VERSION}
        np.testing.assert_array_equal(r.prompt_tokens, prompts[ep.uid])
    driver.close()


class _GradesItself:
    """An environment that grades the answer turn itself: the first turn gets an observation, the second
    is graded, by a reward that raises for row 1."""

    def __init__(self, row):
        self.row, self.turns = row["row"], 0

    def step(self, turn):
        from jaxrl_async.envs import StepResult

        self.turns += 1
        if self.turns == 1:
            return StepResult([5, 6, 7], reward=0.0, done=False)
        if self.row == 1:
            raise RuntimeError("the reward crashed")
        return StepResult(None, reward=1.0, done=True, info={"reason": "answer"})


def test_an_environment_whose_grading_raises_ends_its_episode_with_reward_0(params):
    """A user environment's reward that raises ends that episode (reward 0, "env_error", counted); the
    other episodes and the loop go on."""
    from jaxrl_async.envs import EnvConfig
    from jaxrl_async.envs.driver import EpisodeDriver

    loop = SamplerLoop(_engine(params, "xla"))
    driver = EpisodeDriver(loop, EnvConfig(max_turns=3, max_episode_tokens=64), tokenizer=_Ids(),
                           make_env=_GradesItself, workers=2, max_turn_tokens=3)  # fmt: skip
    for i, p in enumerate(_prompts(2, seed=17, lo=3, hi=6)):
        driver.add(i, {"row": i}, p, n_samples=2, seed=i)
    ended = {(e.uid, e.sample_index): e for e in driver.run()}
    driver.close()
    assert sorted(ended) == [(0, 0), (0, 1), (1, 0), (1, 1)] and driver.env_errors == 2
    for (row, _), e in ended.items():
        want = ("answer", 1.0, 2) if row == 0 else ("env_error", 0.0, 2)
        assert (e.finish_reason, e.reward, e.turns) == want
    assert loop.idle and not loop.parked and loop.free_slots == 4


class _Hangs:
    """Row 0 answers on its second turn (reward 1); row 1's step hangs on its second turn; row 2's
    factory hangs; row 3's factory raises. What hangs waits on `release` (set at the test's end)."""

    release = threading.Event()

    def __init__(self, row):
        self.row, self.turns = row["row"], 0
        if self.row == 2:
            _Hangs.release.wait()
        if self.row == 3:
            raise RuntimeError("the environment cannot start")

    def step(self, turn):
        from jaxrl_async.envs import StepResult

        self.turns += 1
        if self.turns == 1:
            return StepResult([5, 6, 7], reward=0.0, done=False)
        if self.row == 1:
            _Hangs.release.wait()
        return StepResult(None, reward=1.0, done=True, info={"reason": "answer"})


def _hang_driver(params, on_answer=None, workers=4):
    from jaxrl_async.envs import EnvConfig
    from jaxrl_async.envs.driver import EpisodeDriver

    cfg = EnvConfig(max_turns=3, max_episode_tokens=64, tool_timeout_s=0.1, step_timeout_s=0.5)
    return EpisodeDriver(SamplerLoop(_engine(params, "xla")), cfg, tokenizer=_Ids(), make_env=_Hangs,
                         workers=workers, max_turn_tokens=3, on_answer=on_answer)  # fmt: skip


def test_an_environment_that_hangs_or_cannot_start_ends_its_episode_and_the_others_go_on(params):
    """Past config.env.step_timeout_s a hung step or factory ends its episode ("env_timeout", reward 0,
    counted with the env errors), a factory that raises ends it as "env_error"; the stuck workers are
    replaced, so row 0's episodes, queued behind them, still answer; every slot is freed."""
    _Hangs.release.clear()
    driver = _hang_driver(params)
    try:
        for i, p in enumerate(_prompts(4, seed=19, lo=3, hi=6)):
            driver.add(i, {"row": i}, p, n_samples=2, seed=i)
        ended = {(e.uid, e.sample_index): e for e in driver.run()}
        assert sorted(ended) == [(r, s) for r in range(4) for s in range(2)]
        want = {0: ("answer", 1.0, 2), 1: ("env_timeout", 0.0, 2), 2: ("env_timeout", 0.0, 1),
                3: ("env_error", 0.0, 1)}  # fmt: skip
        assert {k: (e.finish_reason, e.reward, e.turns) for k, e in ended.items()} == {
            k: want[k[0]] for k in ended
        }
        assert (driver.env_errors, driver.env_timeouts, driver.stuck) == (6, 4, 4)
        loop = driver.loop
        assert loop.idle and not loop.parked and loop.free_slots == 4
    finally:
        _Hangs.release.set()
        driver.close()


def test_an_environment_timeout_is_recorded_and_replayed_as_the_runs_answer(params):
    """The time-out is an answer of timing: it goes through `on_answer` (the schedule recorder), and a
    replay that applies the record ends the same episode the same way, without asking the environment."""
    from jaxrl_async.runtime.replay_episodes import RecordedAnswers
    from jaxrl_async.runtime.schedule_log import ActorSchedule

    class Records:
        def __init__(self):
            self.recs = []

        def write(self, rec):
            self.recs.append(rec)

        def close(self):
            pass

    writer = Records()
    schedule = ActorSchedule(writer, "actor:0", SamplerConfig(attention="xla", linear="xla"))
    _Hangs.release.clear()
    driver = _hang_driver(params, on_answer=schedule.answered)
    prompt = _prompts(1, seed=23, lo=3, hi=6)[0]
    try:
        driver.add(0, {"row": 2}, prompt, seed=4)
        (run,) = driver.run()
    finally:
        _Hangs.release.set()
        driver.close()
    schedule.close()
    (rec,) = [a for r in writer.recs if "o" in r for a in r["o"]]
    assert rec[3:] == [None, 0.0, "env_timeout"]

    replay = RecordedAnswers(SamplerLoop(_engine(params, "xla")), driver.cfg, _Ids())
    replay.max_turn_tokens = driver.max_turn_tokens  # the run's bound (a run's actor leaves the default)
    replay.add(0, {"row": 2}, prompt, seed=4)
    while not replay.waiting:
        replay.step()
    episode, same, done = replay.answer(rec)
    assert same and done and (episode.finish_reason, episode.reward) == ("env_timeout", 0.0)
    assert episode.tokens == run.tokens and len(run.tokens) == 3
    replay.close()


class _Ids:
    """A tokenizer over raw ids (the scripted environment reads nothing)."""

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(str(int(i)) for i in ids)


def test_a_resume_that_waits_for_pages_nothing_will_free_is_an_error_not_a_hang(params):
    cfg = SamplerConfig(num_slots=2, max_prompt_len=16, max_new_tokens=4, steps_per_call=2, temperature=0.0,
                        attention="paged_kernel", linear="xla", page_size=4, token_budget=24)  # fmt: skip
    loop = SamplerLoop(Engine(TINY, params, MESH1, cfg))
    for uid in ("a", "b"):
        loop.add_request(Request(uid, [1, 2, 3, 4], max_new_tokens=4, park=True))
    loop.run()
    assert sorted(loop.parked) == [("a", 0), ("b", 0)]
    loop.resume("a", 0, list(range(5, 13)), max_new_tokens=4)  # needs more pages than "b" leaves free
    assert loop.stuck
    with pytest.raises(RuntimeError, match="token_budget"):
        loop.run()
    loop.finish("b", 0)  # its pages free: the resume goes on
    turn = _by_uid(loop.run())[("a", 0)]
    assert len(turn.tokens) == 4 and not loop.stuck
    loop.finish("a", 0)
    table = loop.planner.table
    assert table.num_free(0) == table.capacity


def test_a_stuck_environment_step_or_tool_does_not_keep_the_process_from_exiting():
    """The driver's and the tool executor's threads are daemons: a ThreadPoolExecutor's are joined at
    interpreter exit, so one step or tool call that never returns would hang the actor's process at the
    end of the run. The tool's caller gets its time-out answer and the process still ends."""
    import os
    import subprocess
    import sys

    code = (
        "import threading\n"
        "from jaxrl_async.envs.calls import ToolCall\n"
        "from jaxrl_async.envs.executor import ToolExecutor\n"
        "from jaxrl_async.envs.tools import register_tool\n"
        "from jaxrl_async.envs.workers import DaemonPool\n"
        "workers = DaemonPool(2)\n"
        "stuck = workers.submit(threading.Event().wait)\n"
        "assert workers.submit(sum, [1, 2]).result(timeout=60) == 3 and stuck.running()\n"
        "workers.shutdown(cancel=True)\n"
        "register_tool('never_returns')(lambda arg='': threading.Event().wait())\n"
        "tools = ToolExecutor(['never_returns'], timeout_s=0.2, workers=1, max_chars=100)\n"
        "out = tools.run(ToolCall('never_returns', ('x',), ()))\n"
        "assert out.error == 'timeout' and tools.stats.abandoned == 1, (out, tools.stats.abandoned)\n"
        "tools.close()\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
