"""The actor's parts, each on its own: the ticket book (how many prompts to ask for, the requests of a
grant, when a drained report goes out) and the group assembly (graded completions to whole groups, with
the overlong shaping), the latter with the real reward service. No model or engine: seconds."""

import time

import numpy as np

from jaxrl_async.data.letter_range import letter_range_problem
from jaxrl_async.data.prompt import Prompt
from jaxrl_async.rewards import RewardConfig
from jaxrl_async.rewards.service import RewardService
from jaxrl_async.run_config import Schedule
from jaxrl_async.runtime.messages import Tickets
from jaxrl_async.runtime.rollout_groups import GroupAssembly
from jaxrl_async.runtime.tickets import TicketBook
from jaxrl_async.sampler.loop import Completion
from jaxrl_async.tokenizer import CharTokenizer

SCHEDULE = Schedule(mode="async", total_steps=4, prompts_per_step=4, samples_per_prompt=2, max_staleness=1)


def _prompt(uid: str, first: str, last: str, tok) -> Prompt:
    text, answer = letter_range_problem(first, last)
    meta = {"answer": answer, "task": "letter_range", "first": first, "last": last}
    return Prompt(uid, text, np.asarray(tok.encode(text), np.int32), answer, meta)


def test_ticket_book_asks_for_the_free_slots_plus_the_lookahead_once():
    book = TicketBook(index=0, seed=3, schedule=SCHEDULE, num_slots=4, actors=2)
    # two engines' worth of prompts (2 * 4 slots / 2 samples) plus this actor's half of a step's 4
    assert book.lookahead == 4 + 2
    assert book.want(free_slots=4, admitted=0) == 2 + 6  # the free slots' prompts and the lookahead
    assert book.want(free_slots=4, admitted=0) == 0  # already asked: nothing more until answered
    tok = CharTokenizer()
    requests = book.grant(Tickets([(7, _prompt("u7", "a", "d", tok)), (8, _prompt("u8", "x", "C", tok))]))
    assert (book.granted, book.asked, book.queued(admitted=1)) == (2, 6, 1)
    assert [(r.uid, r.n_samples, r.seed) for r in requests] == [(7, 2, 3 * 1_000_003 + 7),
                                                              (8, 2, 3 * 1_000_003 + 8)]  # fmt: skip
    assert requests[0].prompt_tokens == tuple(tok.encode("range a-d:"))
    assert requests[1].metadata.uid == "u8" and requests[1].max_new_tokens is None
    book.grant(Tickets([], exhausted=True))
    assert book.exhausted and book.want(free_slots=4, admitted=2) == 0  # the data ended: never ask again


def test_ticket_book_reports_groups_always_and_a_drain_once_per_grant():
    cap = lambda gid: gid  # a group's generation cap: its id
    book = TicketBook(index=0, seed=0, schedule=SCHEDULE, num_slots=4, actors=1, max_new_tokens_fn=cap)
    assert book.report_due(groups_ready=True, drained=False)
    assert not book.report_due(groups_ready=False, drained=False)
    assert book.report_due(groups_ready=False, drained=True)  # the first time it has nothing left
    assert not book.report_due(groups_ready=False, drained=True)  # said once
    requests = book.grant(Tickets([(5, _prompt("u", "a", "b", CharTokenizer()))]))
    assert requests[0].max_new_tokens == 5
    assert book.report_due(groups_ready=False, drained=True)  # a new grant, then drained again: said again


def _completion(gid: int, index: int, prompt: Prompt, text: str, tok) -> Completion:
    tokens = np.asarray(tok.encode(text), np.int32)
    n = len(tokens)
    return Completion(uid=gid, sample_index=index, prompt_tokens=tuple(prompt.tokens), tokens=tokens,
                      logprobs=np.zeros(n, np.float32), sample_logprobs=np.zeros(n, np.float32),
                      versions=np.zeros(n, np.int64), finish_reason="stop", metadata=prompt)  # fmt: skip


def test_group_assembly_sends_whole_sorted_groups_with_the_overlong_shaping():
    tok = CharTokenizer()
    cfg = RewardConfig(reward="letter_range", num_workers=1, overlong_buffer=4, overlong_penalty=1.0)
    with RewardService(cfg) as rewards:
        groups = GroupAssembly(samples_per_prompt=2, reward=cfg, max_new_tokens=8, rewards=rewards,
                               tokenizer=tok)  # fmt: skip
        p = _prompt("u1", "a", "d", tok)
        # sample 1 is right and short; sample 0 is wrong and 7 tokens long, 3 into the 4-token buffer
        groups.submit([_completion(11, 1, p, "abcd", tok), _completion(11, 0, p, "abcdefg", tok)])
        assert groups.sample_tokens == 11 and len(groups.pending) == 2
        deadline = time.monotonic() + 60
        while groups.pending and time.monotonic() < deadline:
            for result in rewards.poll():
                groups.add(result)
                assert groups.ready == [] or not groups.pending  # no half group is ever ready
            rewards.wait(0.05)
    assert not groups.partial
    (group,) = groups.take_ready()
    assert groups.ready == [] and groups.groups_sent == 1
    assert [r.sample_index for r in group] == [0, 1]
    assert group[1].reward == 1.0 and group[1].metadata["overlong_penalty"] == 0.0
    assert group[0].reward == -0.75 and group[0].metadata["overlong_penalty"] == -0.75
    assert group[0].metadata["text"] == "abcdefg" and group[0].group_id == 11
