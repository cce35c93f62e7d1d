"""The coordinator: AReaL's admission bound, the ledger of prompts in flight, dropped groups, resume."""

import functools
import json

from jaxrl_async.data import DataConfig, make_prompt_iterator, prompt_at
from jaxrl_async.runtime.coordinator import Coordinator
from jaxrl_async.runtime.messages import TicketRequest, Tickets, Trained
from jaxrl_async.runtime.transport import LocalTransport
from jaxrl_async.tokenizer import load_tokenizer

TOK = load_tokenizer("char")
DATA = DataConfig(task="arithmetic", num_train=12, num_epochs=1, seed=3)


def _coordinator(tmp_path, b=2, max_staleness=1, state=None, version=0):
    t = LocalTransport()
    c = Coordinator(
        make_prompt_iterator(DATA, TOK), b, max_staleness, t, version=version, state=state,
        lookup=functools.partial(prompt_at, DATA, TOK), trained_log=str(tmp_path / "trained_uids.jsonl"),
    )  # fmt: skip
    return c, t


def _ask(c, t, n=0, **trained) -> list:
    """Sends a request for `n` prompts (and/or a Trained message); returns the (gid, key) granted."""
    if trained:
        t.send("coordinator", Trained(**trained))
    if n:
        t.send("coordinator", TicketRequest(0, n))
    c.poll()
    return [(gid, p.key) for m in t.recv("actor:0") if isinstance(m, Tickets) for gid, p in m.prompts]


def test_admission_holds_eta_and_waits_for_versions(tmp_path):
    c, t = _coordinator(tmp_path, b=2, max_staleness=1)
    first = _ask(c, t, 10)
    assert [g for g, _ in first] == [0, 1, 2, 3]  # (max_staleness + 1) * B prompts before any training
    second = _ask(c, t, version=1, group_ids=[0, 1])  # version 1 opens one more batch
    assert [g for g, _ in second] == [4, 5]
    assert c.max_ahead == 1 and c.demand == {0: 4}
    lines = [json.loads(x) for x in open(tmp_path / "trained_uids.jsonl")]
    assert lines == [{"version": 1, "uids": [first[0][1], first[1][1]]}]


def test_dropped_groups_start_again_on_their_own_budget(tmp_path):
    c, t = _coordinator(tmp_path, b=2, max_staleness=1)
    granted = _ask(c, t, 4)
    started = c.controller.started
    # The learner drops groups 0 and 1 as too stale: they come back first, under the same ids, and cost
    # no new admission; then version 1 trains them and the bound moves on as if nothing was dropped.
    again = _ask(c, t, 2, version=0, group_ids=[], dropped=[0, 1])
    assert again == granted[:2] and c.controller.started == started
    for v in range(1, 4):  # each version: the two oldest groups are trained, the next two dropped
        oldest = sorted(c.in_flight)[:4]
        _ask(c, t, 0, version=v - 1, group_ids=[], dropped=oldest[2:])
        _ask(c, t, 4, version=v, group_ids=oldest[:2])
        assert c.controller.started == (v + 2) * 2, "admission still runs max_staleness versions ahead"
        assert len(c.in_flight) == 4


def test_filtered_groups_return_their_budget_and_leave_the_ledger(tmp_path):
    # Dynamic sampling: each group the learner discards makes room for exactly one new prompt, and the
    # bound counts the groups that can still be trained: (max_staleness + 1) * B of them before version 1.
    c, t = _coordinator(tmp_path, b=2, max_staleness=1)
    assert [g for g, _ in _ask(c, t, 10)] == [0, 1, 2, 3]
    more = _ask(c, t, version=0, group_ids=[], filtered=[1, 2])
    assert [g for g, _ in more] == [4, 5]  # new ids (new seeds), on the returned budget
    assert sorted(c.in_flight) == [0, 3, 4, 5] and c.controller.counted == 4
    assert c.max_ahead <= 1 and c.summary()["prompts_filtered"] == 2
    assert _ask(c, t, version=0, group_ids=[], filtered=[1]) == []  # already gone: no double refund
    state = json.loads(json.dumps(c.state()))
    assert (state["started"], state["filtered"]) == (6, 2)
    c.close()
    c, t = _coordinator(tmp_path, b=2, max_staleness=1, state=state, version=0)
    assert c.controller.counted == 4 and not c.controller.can_admit(0)
    c.close()


def test_resume_starts_in_flight_prompts_again_and_skips_none(tmp_path):
    # Train a 12-prompt epoch with a checkpoint and a restart in the middle: every prompt trained once.
    c, t = _coordinator(tmp_path, b=2, max_staleness=1)
    v = 0
    granted = _ask(c, t, 4)
    for _ in range(2):
        v += 1
        batch = [g for g, _ in granted[:2]]
        granted = granted[2:] + _ask(c, t, 2, version=v, group_ids=batch)
    state = json.loads(json.dumps(c.state()))  # what a checkpoint keeps (JSON)
    c.close()
    assert [g for g, _ in state["in_flight"]] == [4, 5, 6, 7]
    c, t = _coordinator(tmp_path, b=2, max_staleness=1, state=state, version=v)
    granted = _ask(c, t, 10)
    assert [g for g, _ in granted[:4]] == [4, 5, 6, 7]  # regenerated first, same ids (same seeds)
    while granted:
        v += 1
        batch = [g for g, _ in granted[:2]]
        granted = granted[2:] + _ask(c, t, 2, version=v, group_ids=batch)
    c.close()
    last = {}
    for line in open(tmp_path / "trained_uids.jsonl"):
        row = json.loads(line)
        last[row["version"]] = row["uids"]
    uids = [u for v in sorted(last) for u in last[v]]
    assert sorted(uids) == sorted(f"0:{r}" for r in range(12))  # each prompt of the epoch once
    assert sorted(last) == list(range(1, v + 1))
