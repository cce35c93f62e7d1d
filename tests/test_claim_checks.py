"""Break tests: the checks behind claims 3 and 9 (tests/claims.py, shared with the run tests that make them)
fail when the claim is broken, and pass when it holds.

Claim 3 (tests/test_multiprocess.py's kill test, tests/test_resume.py's SIGKILL test): every prompt trained
exactly once across a kill and a resume. Here a real `Coordinator` writes the ledger in-process through a
kill (a version trained after the checkpoint, lost with its process) and a resume from the checkpoint; a
checkpoint that loses a prompt in flight, or puts an already trained one back in flight, or a version
logged without one of its prompts, makes the same check fail.

Claim 9 (tests/test_orchestrator.py's async end-to-end test, the two-replica test): the per-token
staleness bound. Batches of rollouts go through the learner's own staleness figures
(`rollouts.staleness_stats`, `learner_log.staleness_values`) into the same check: rollouts that break the
bound (a sample started more than η versions back, a token from an older policy than its sample's first)
fail it."""

import json

import numpy as np
import pytest

from jaxrl_async.rollouts import Rollout, staleness_stats
from jaxrl_async.runtime.learner_log import staleness_values
from tests.claims import (
    assert_each_prompt_trained_once,
    assert_staleness_bound,
    ledger_problems,
    read_ledger,
    staleness_problems,
)
from tests.test_coordinator import _ask, _coordinator

B = 2  # prompts per version; tests/test_coordinator.py's 12-prompt epoch, max_staleness 1


def _train(c, t, granted, version):
    """Version `version` trains the two oldest granted groups; the actor asks for two more."""
    batch = [g for g, _ in granted[:B]]
    return granted[B:] + _ask(c, t, B, version=version, group_ids=batch)


def _kill_and_resume(tmp_path, steps, broken=None):
    """Versions 1..3 with a checkpoint after version 2; version 3 is trained (its ledger line written) and
    lost with its process; a coordinator resumed from the checkpoint (passed through `broken` first, if
    given) trains versions 3..`steps`. Returns (the ledger, the coordinator's final state)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    c, t = _coordinator(tmp_path, b=B, max_staleness=1)
    granted = _ask(c, t, 2 * B)
    for v in (1, 2, 3):
        granted = _train(c, t, granted, v)
        if v == 2:
            checkpoint = json.loads(json.dumps(c.state()))  # what the checkpoint keeps (JSON)
    c.close()
    if broken is not None:
        broken(checkpoint)
    c, t = _coordinator(tmp_path, b=B, max_staleness=1, state=checkpoint, version=2)
    granted = _ask(c, t, 10)
    for v in range(3, steps + 1):
        granted = _train(c, t, granted, v)
    final = json.loads(json.dumps(c.state()))
    c.close()
    return read_ledger(tmp_path), final


def _check_like_the_kill_test(last, final, steps):
    """tests/test_multiprocess.py's kill test's check, on this ledger and final state."""
    assert_each_prompt_trained_once(last, steps, B, started=final["started"],
                                    in_flight=[key for _, key in final["in_flight"]])  # fmt: skip


EPOCH = [f"0:{r}" for r in range(12)]


def test_the_ledger_check_passes_a_kill_and_resume_that_trains_every_prompt_once(tmp_path):
    last, final = _kill_and_resume(tmp_path / "mid", steps=4)
    assert final["in_flight"] and final["started"] > 4 * B  # the kill test's form: prompts still in flight
    _check_like_the_kill_test(last, final, 4)
    lines = (tmp_path / "mid" / "trained_uids.jsonl").read_text().splitlines()
    assert [json.loads(x)["version"] for x in lines] == [1, 2, 3, 3, 4]  # version 3 lost and trained again
    last, final = _kill_and_resume(tmp_path / "epoch", steps=6)  # test_resume's form: the whole epoch
    assert_each_prompt_trained_once(last, 6, B, epoch=EPOCH)
    _check_like_the_kill_test(last, final, 6)


def test_the_ledger_check_fails_when_the_checkpoint_loses_a_prompt_in_flight(tmp_path):
    def drop(state):
        state["in_flight"].pop(0)

    last, final = _kill_and_resume(tmp_path / "mid", steps=4, broken=drop)
    with pytest.raises(AssertionError, match=r"1 lost"):
        _check_like_the_kill_test(last, final, 4)
    last, final = _kill_and_resume(tmp_path / "epoch", steps=6, broken=drop)
    problems = ledger_problems(last, 6, B, epoch=EPOCH)
    assert any(p.startswith("prompts of the epoch never trained") for p in problems), problems
    with pytest.raises(AssertionError):
        _check_like_the_kill_test(last, final, 6)


def test_the_ledger_check_fails_when_a_trained_prompt_is_trained_again(tmp_path):
    def duplicate(state):
        first = json.loads((tmp_path / "trained_uids.jsonl").read_text().splitlines()[0])["uids"][0]
        state["in_flight"].insert(0, [99, first])  # version 1's prompt back in flight

    last, final = _kill_and_resume(tmp_path, steps=4, broken=duplicate)
    with pytest.raises(AssertionError, match=r"prompts trained in more than one version: \['0:"):
        _check_like_the_kill_test(last, final, 4)


def test_the_ledger_check_fails_on_a_version_without_one_of_its_prompts_or_a_missing_version(tmp_path):
    last, final = _kill_and_resume(tmp_path, steps=4)
    short = {**last, 2: last[2][:1]}
    with pytest.raises(AssertionError, match=r"not trained on 2 prompts \(version: prompts\): \{2: 1\}"):
        _check_like_the_kill_test(short, final, 4)
    gap = {v: u for v, u in last.items() if v != 3}
    with pytest.raises(AssertionError, match=r"versions \[1, 2, 4\], not 1\.\.4"):
        _check_like_the_kill_test(gap, final, 4)
    # A prompt both trained and left in flight by the final state.
    stuck = {**final, "in_flight": [*final["in_flight"], [99, last[1][0]]], "started": final["started"] + 1}
    with pytest.raises(AssertionError, match=r"prompts trained and still in flight"):
        _check_like_the_kill_test(last, stuck, 4)


def _rollout(versions, group_id=0) -> Rollout:
    n = len(versions)
    return Rollout.for_trainer([1, 2], [3] * n, np.zeros(n, np.float32), np.asarray(versions, np.int32), 0.0,
                               group_id)  # fmt: skip


def _scalars(batches) -> dict:
    """TensorBoard scalars (`metrics.read_scalars`' shape) of train steps 1, 2, ..., one batch each, from the
    learner's own figures: step s trains from version s - 1 (`Learner._log_step`)."""
    out: dict[str, list] = {}
    for step, groups in enumerate(batches, start=1):
        for tag, value in staleness_values(staleness_stats(groups, step - 1), 0).items():
            out.setdefault(tag, []).append((step, value))
    return out


def _good(step):
    """Step `step`'s batch under η = 1: one sample started a version back and finished on the newest
    policy (an in-flight update), one all on the newest."""
    v = step - 1
    return [[_rollout([max(v - 1, 0), max(v - 1, 0), v], 0), _rollout([v, v], 0)]]


def test_the_staleness_check_passes_rollouts_within_the_bound():
    scalars = _scalars([_good(s) for s in (1, 2, 3, 4)])
    assert [v for _, v in scalars["staleness/max"]] == [0, 1, 1, 1]
    assert_staleness_bound(scalars, eta=1, steps=4)


def test_the_staleness_check_fails_on_rollouts_that_break_the_bound():
    # A sample whose first token is two versions older than the policy it trains (η = 1).
    too_old = [_good(1), _good(2), [[_rollout([0, 1, 2], 0)]], _good(4)]
    with pytest.raises(AssertionError, match=r"step 3: token staleness max 2\.0, head max 2\.0, eta 1"):
        assert_staleness_bound(_scalars(too_old), eta=1, steps=4)
    # A token from an older policy than its sample's first token (head staleness 0, that token's 1).
    backwards = [_good(1), _good(2), _good(3), [[_rollout([3, 2, 3], 0)]]]
    with pytest.raises(AssertionError, match=r"step 4: token staleness max 1\.0, head max 0\.0"):
        assert_staleness_bound(_scalars(backwards), eta=1, steps=4)
    # A step that logged no staleness.
    scalars = _scalars([_good(s) for s in (1, 2, 3, 4)])
    missing = {tag: [(s, v) for s, v in series if s != 2] for tag, series in scalars.items()}
    assert staleness_problems(missing, eta=1, steps=4) == [
        "steps logged: head [1, 3, 4], token [1, 3, 4]; expected 1..4"
    ]
