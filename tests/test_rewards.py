"""Reward registry, math verifier, format/code rewards and the reward worker pool."""

import collections
import json
import multiprocessing as mp
import sys
import textwrap
import time

import pytest

from jaxrl_async.rewards import (
    Graded,
    QueueFull,
    RewardConfig,
    RewardService,
    as_graded,
    get_reward,
    grade_one,
    list_rewards,
    register_reward,
)
from jaxrl_async.rewards.answers import extract_boxed, extract_gsm8k, reference_answer
from jaxrl_async.rewards.code import Opaque, code_reward, strict_equal
from jaxrl_async.rewards.math import MAX_ANSWERS, answer_kind, format_reward, is_equivalent, math_reward
from jaxrl_async.rewards.sandbox import wire
from jaxrl_async.rewards.synthetic import arithmetic_reward, countdown_reward, countdown_verify

USER_MODULE = textwrap.dedent(
    """
    import os, time
    from jaxrl_async.rewards import register_reward

    @register_reward("user_len")
    def length_reward(prompt, completion, metadata):
        return len(completion) / 10

    def hang(prompt, completion, metadata):
        time.sleep(600)

    def boom(prompt, completion, metadata):
        raise RuntimeError("boom")

    def die(prompt, completion, metadata):
        os._exit(7)

    def not_a_number(prompt, completion, metadata):
        return "high"

    def slow(prompt, completion, metadata):
        time.sleep(0.3)
        return 1.0
    """
)


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    """A user reward module on sys.path; spawned workers inherit sys.path, so they can import it."""
    d = tmp_path_factory.mktemp("user_rewards")
    (d / "my_rewards.py").write_text(USER_MODULE)
    sys.path.insert(0, str(d))
    yield "my_rewards"
    sys.path.remove(str(d))


# ---- math verifier ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("so the result is \\boxed{\\frac{1}{2}}", "0.5"),
        ("The answer is $\\frac{3}{4}$", "0.75"),
        ("\\boxed{\\dfrac{6}{4}}", "\\frac{3}{2}"),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        ("Total: \\boxed{1,000}", "1000"),
        ("work...\n#### 72", "72"),
        ("<answer>3/4</answer>", "\\frac{3}{4}"),
        ("\\boxed{0.50}", "1/2"),
        ("\\boxed{\\frac{x^2-1}{x-1}}", "\\frac{(x-1)(x+1)}{x-1}"),
    ],
)
def test_math_equivalent_forms_accepted(completion, answer):
    assert is_equivalent(completion, answer)
    assert math_reward("q", completion, {"answer": answer}).reward == 1.0


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("\\boxed{\\frac{1}{3}}", "0.5"),
        ("#### 71", "72"),
        ("\\boxed{2\\sqrt{3}}", "\\sqrt{8}"),
        ("\\boxed{-4}", "4"),
        ("I think it is 10, no, \\boxed{11}", "10"),  # the final boxed answer counts, not earlier ones
    ],
)
def test_math_wrong_answers_rejected(completion, answer):
    assert not is_equivalent(completion, answer)
    assert math_reward("q", completion, {"answer": answer}).reward == 0.0


@pytest.mark.parametrize(
    "completion, answer, reason",
    [
        ("\\boxed{1} \\boxed{2} \\boxed{3} \\boxed{4}", "4", "conflicting_answers"),
        ("\\boxed{3} or maybe \\boxed{4}", "4", "conflicting_answers"),
        ("<answer>3</answer> <answer>4</answer>", "4", "conflicting_answers"),
        (" ".join(f"\\boxed{{{i} - {i} + 4}}" for i in range(MAX_ANSWERS + 1)), "4", "too_many_answers"),
    ],
)
def test_math_agree_rule_rejects_several_answers(completion, answer, reason):
    assert math_reward("q", completion, {"answer": answer, "answer_rule": "agree"}) == Graded(0.0, reason)


def test_math_last_rule_grades_only_the_final_answer():
    corrected = "first \\boxed{5}, then corrected: \\boxed{7}"
    assert math_reward("q", corrected, {"answer": "7"}) == Graded(1.0, "")  # "last" is the default
    assert math_reward("q", corrected, {"answer": "5"}).reward == 0.0
    agree = {"answer": "7", "answer_rule": "agree"}
    assert math_reward("q", corrected, agree) == Graded(0.0, "conflicting_answers")
    # Listing answers gains nothing: the right one anywhere but last scores 0.
    assert math_reward("q", "\\boxed{4} \\boxed{1} \\boxed{2}", {"answer": "4"}).reward == 0.0
    # Sets, intervals and plus-minus stay rejected under "last".
    assert math_reward("q", "\\boxed{\\pm 4}", {"answer": "4"}) == Graded(0.0, "not_a_single_value")
    with pytest.raises(ValueError, match="answer_rule"):
        math_reward("q", corrected, {"answer": "7", "answer_rule": "first"})


def test_reward_config_answer_rule():
    assert grade_one(RewardConfig(reward="math"), "q", "\\boxed{5} no: \\boxed{7}", {"answer": "7"})[0] == 1.0
    agree = RewardConfig(reward="math", answer_rule="agree")
    assert grade_one(agree, "q", "\\boxed{5} no: \\boxed{7}", {"answer": "7"})[:2] == (0.0, "ok")
    with pytest.raises(ValueError, match="answer_rule"):
        RewardConfig(reward="math", answer_rule="first")


@pytest.mark.parametrize(
    "completion, answer, reason",
    [
        ("\\boxed{\\{1, 2, 3, 4, 5\\}}", "4", "not_a_single_value"),
        ("\\boxed{1, 2, 3, 4}", "4", "not_a_single_value"),
        ("\\boxed{[0, 10]}", "4", "not_a_single_value"),
        ("\\boxed{x \\in [0, 10]}", "4", "not_a_single_value"),
        ("\\boxed{0 \\le x \\le 10}", "4", "not_a_single_value"),
        ("\\boxed{\\pm 4}", "4", "not_a_single_value"),
        ("\\boxed{3 = x = 4}", "4", "not_a_single_value"),
        ("\\boxed{3 \\\\ 4}", "4", "not_a_single_value"),
        ("\\boxed{3 \\vee 4}", "4", "not_a_single_value"),
        ("\\boxed{3 \\cup 4}", "4", "not_a_single_value"),
        ("\\boxed{\\mathbb{R}}", "4", "not_a_single_value"),
        ("\\boxed{4}", "[0, 10]", "expected a set"),
    ],
)
def test_math_hedged_answers_score_zero(completion, answer, reason):
    assert math_reward("q", completion, {"answer": answer}) == Graded(0.0, reason)


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("\\boxed{4}, and checking: \\boxed{4}", "4"),
        ("\\boxed{\\frac{8}{2}} which is \\boxed{4}", "4"),
        ("\\boxed{x = \\frac{8}{2} = 4}", "4"),
        ("\\boxed{[0, 10]}", "[0, 10]"),
        ("\\boxed{1, 2}", "2, 1"),
        ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
        ("\\boxed{2 \\pm 1}", "2 \\pm 1"),
    ],
)
def test_math_single_answers_in_many_forms_accepted(completion, answer):
    assert math_reward("q", completion, {"answer": answer}) == Graded(1.0, "")


def test_answer_kinds():
    from math_verify import parse

    kinds = {s: answer_kind(parse(s)) for s in ["$4$", "$x = 4$", "$\\{4\\}$", "$[1, 2]$", "$\\{1, 2\\}$",
                                                 "$x > 1$", "$3 = x = 4$", "$(1, 2, 3)$"]}
    assert kinds == {"$4$": "value", "$x = 4$": "value", "$\\{4\\}$": "value", "$[1, 2]$": "set",
                     "$\\{1, 2\\}$": "set", "$x > 1$": "relation", "$3 = x = 4$": "conflict",
                     "$(1, 2, 3)$": "tuple"}


def test_math_without_answer_is_zero_with_reason():
    out = math_reward("q", "I don't know", {"answer": "3"})
    assert out == Graded(0.0, "no_answer")


def test_answer_extraction():
    assert extract_boxed("a \\boxed{\\frac{a}{b}} then \\boxed{x^{2}}") == "x^{2}"
    assert extract_boxed("\\boxed{unclosed") is None
    assert extract_gsm8k("no marker") is None
    assert reference_answer("3 + 4 = <<3+4=7>>7 apples\n#### 1,007") == "1007"
    assert reference_answer("So it is $\\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    assert reference_answer("  \\frac{1}{2} ") == "\\frac{1}{2}"
    assert reference_answer("it is \\boxed{unclosed") is None and reference_answer("####  ") is None


def test_math_reward_takes_the_final_answer_of_a_reference_solution():
    gsm8k = {"answer": "3 + 4 = <<3+4=7>>7 apples\n#### 1,007"}
    assert math_reward("q", "\\boxed{1007}", gsm8k).reward == 1.0
    assert math_reward("q", "\\boxed{7}", gsm8k).reward == 0.0  # not the 7 of the worked steps
    solution = {"answer": "We get $x = 2 + 1 = \\boxed{3}$."}
    assert math_reward("q", "#### 3", solution).reward == 1.0
    with pytest.raises(ValueError, match="no final answer"):
        math_reward("q", "\\boxed{3}", {"answer": "it is \\boxed{3"})


def test_format_reward():
    assert format_reward("q", "x \\boxed{3}", {}) == 1.0
    assert format_reward("q", "blah\n#### 4", {}) == 1.0
    assert format_reward("q", "<answer>4</answer>", {}) == 1.0
    assert format_reward("q", "just 4", {}) == 0.0
    assert format_reward("q", "ANSWER=4", {"format_regex": r"ANSWER=\d+"}) == 1.0


# ---- registry -----------------------------------------------------------------------------------------


def test_registry_builtins_and_import_paths():
    assert {"arithmetic", "countdown", "math", "code", "format"} <= set(list_rewards())
    assert get_reward("arithmetic")("37+85=", " 122 ", {"answer": "122"}) == 1.0
    assert get_reward("arithmetic")("37+85=", "123", {"answer": "122"}) == 0.0
    assert get_reward("jaxrl_async.rewards.math:format_reward") is format_reward
    with pytest.raises(KeyError, match="unknown reward 'nope'"):
        get_reward("nope")


def test_synthetic_verifiers_read_the_metadata_not_the_prompt():
    assert arithmetic_reward("37+85=", "7", {"answer": "7"}) == 1.0  # the prompt's text is not consulted
    with pytest.raises(KeyError, match="answer"):
        arithmetic_reward("37+85=", "122", {})
    meta = {"numbers": [5, 8, 8], "target": 24}
    assert countdown_reward("anything", "(8-5)*8", meta) == 1.0
    assert countdown_reward("anything", "8*3", meta) == 0.0
    with pytest.raises(KeyError, match="numbers"):
        countdown_reward("make 24 with 5 8 8:", "(8-5)*8", {})


def test_countdown_verifier_rejects_cheats():
    assert countdown_verify("(8-5)*8", [5, 8, 8], 24)
    assert countdown_verify(" 6/(1-3/4) ", [1, 3, 4, 6], 24)  # exact rationals
    assert not countdown_verify("8*3", [3, 5, 8], 24)  # 5 unused
    assert not countdown_verify("8*3*1", [3, 8], 24)  # 1 not given
    assert not countdown_verify("(8-5)*8", [5, 8], 24)  # 8 used twice
    assert not countdown_verify("2**5-8", [2, 5, 8], 24)  # power not allowed
    assert not countdown_verify("__import__('os')", [1], 1)
    assert not countdown_verify("8/(5-5)", [8, 5, 5], 24)


def test_register_reward_decorator():
    @register_reward("test_const_reward")
    def const(prompt, completion, metadata):
        return 0.25

    assert get_reward("test_const_reward") is const
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_const_reward")(lambda p, c, m: 1.0)
    with pytest.raises(ValueError, match="invalid name"):
        register_reward("a:b")


def test_as_graded_rejects_bad_values():
    assert as_graded(1) == Graded(1.0, "")
    with pytest.raises(ValueError, match="non-finite"):
        as_graded(float("nan"))
    with pytest.raises(TypeError):
        as_graded("1.0")


def test_grade_one_never_raises_and_adds_format_weight():
    cfg = RewardConfig(reward="math", format_weight=0.5)
    assert grade_one(cfg, "q", "\\boxed{2}", {"answer": "2"})[:2] == (1.5, "ok")
    reward, reason, _ = grade_one(cfg, "q", "\\boxed{2}", {})  # no answer in metadata
    assert (reward, reason) == (0.0, "error:KeyError")


def test_config_validation():
    with pytest.raises(KeyError, match="unknown reward"):
        RewardConfig(reward="does_not_exist")
    with pytest.raises(KeyError, match="pkg.module:fn"):
        RewardConfig(reward="no_module:")
    with pytest.raises(ValueError, match="num_workers"):
        RewardConfig(num_workers=0)
    with pytest.raises(ValueError, match="mp_context"):
        RewardConfig(mp_context="fork")


# ---- code reward (in-process) --------------------------------------------------------------------------


def test_code_reward_counts_passed_tests():
    # Run in a spawned process: the sandbox forks, which is unsafe beside JAX threads in this process.
    code = "jaxrl_async.rewards.code:code_reward"
    with mp.get_context("spawn").Pool(1) as pool:
        run = lambda completion, meta: pool.apply(
            grade_one, (RewardConfig(reward=code), "p", completion, meta)
        )
        completion = "Here you go:\n```python\nn = int(input())\nprint(n * n)\n```\n"
        tests = [
            {"input": "3", "output": "9"},
            {"input": "4", "output": "16"},
            {"input": "5", "output": "26"},
        ]
        reward, reason, info = run(completion, {"tests": tests, "stop_on_failure": False})
        assert (reward, reason) == (pytest.approx(2 / 3), "ok") and "wrong_output" in info
        assert run("def f(x):\n    return x + 1\n", {"test_code": "assert f(1) == 2"})[0] == 1.0
        reward, _, info = run("def f(x):\n    return x\n", {"test_code": "assert f(1) == 2"})
        assert reward == 0.0 and "AssertionError (test_code line 1)" in info
        reward, reason, info = run("print(1)", {"tests": tests, "sandbox": {"walltime": 3}})
        assert reason == "error:ValueError" and "unknown sandbox limits" in info
        # All three kinds in one request: 2 stdin/stdout tests + 2 cases + test_code = 5 units.
        program = "def f(x):\n    return x * x\n\nif __name__ == '__main__':\n    print(f(int(input())))\n"
        meta = {
            "tests": [{"input": "3", "output": "9"}, {"input": "4", "output": "16"}],
            "entry_point": "f",
            "cases": [{"args": [3], "expected": 9}, {"args": [], "kwargs": {"x": 2.5}, "expected": 6.25}],
            "test_code": "assert f(5) == 25",
        }
        assert run(program, meta)[:2] == (1.0, "ok")
        reward, _, info = run(program.replace("x * x", "x * x + 1"), {**meta, "stop_on_failure": False})
        assert reward == pytest.approx(0.0) and "wrong_output" in info
        reward, _, info = run(program, {**meta, "cases": [*meta["cases"], {"args": [2], "expected": 4.0}]})
        assert reward == pytest.approx(4 / 6) and "case 2: wrong value 4" in info  # 4 is not 4.0


@pytest.mark.parametrize(
    "meta, message",
    [
        ({"cases": [{"args": [1], "expected": 1}]}, "entry_point"),
        ({"entry_point": "f()", "cases": [{"args": [1], "expected": 1}]}, "entry_point"),
        ({"entry_point": "f", "cases": [{"args": [1]}]}, r"cases\[0\] must be a mapping with 'expected'"),
        ({"entry_point": "f", "cases": [{"args": 1, "expected": 1}]}, r"cases\[0\].args must be a list"),
        ({"entry_point": "f", "cases": [{"args": [object()], "expected": 1}]}, r"cases\[0\].args is not"),
        ({"entry_point": "f", "cases": [{"args": [], "expected": {1, object()}}]}, r"cases\[0\].expected"),
        ({"entry_point": "f", "cases": [{"kwargs": {1: 2}, "expected": 1}]}, "keys must be argument names"),
        ({"entry_point": "f", "cases": [{"expected": 1}], "float_tol": "tiny"}, "float_tol must be a number"),
        ({"tests": [{"input": "", "output": "1"}], "cases": [{"expected": 1}]}, "entry_point"),
        ({"prompt": "x"}, "none of 'tests', 'cases' or 'test_code'"),
    ],
)
def test_code_reward_rejects_bad_cases(meta, message):
    with pytest.raises(ValueError, match=message):
        code_reward("p", "def f(x):\n    return x\n", meta)


# ---- the harness codec and strict equality ---------------------------------------------------------------


class _IntEqAll(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class _ListEqAll(list):
    def __eq__(self, other):
        return True


def test_codec_round_trips_plain_data():
    values = [None, True, 0, -7, 2**200, -(2**70), 1.5, float("inf"), "é\n", b"\x00\xff", 1 + 2j,
              [1, [2, (3,)]], (1, "a"), {"k": [1], 2: None, (1, 2): {3}}, {1, 2}, frozenset({"a"}), [], {}]
    for v in values:
        tree = wire.encode(v)
        json.dumps(tree)  # JSON-able
        back = wire.decode(json.loads(json.dumps(tree)))
        assert back == v and type(back) is type(v)
    nan = wire.decode(json.loads(json.dumps(wire.encode(float("nan")))))
    assert nan != nan


def test_codec_copies_builtin_subclasses_without_running_their_code():
    assert type(wire.decode(wire.encode(_IntEqAll(3)))) is int
    assert wire.decode(wire.encode(_IntEqAll(3))) == 3
    copied = wire.decode(wire.encode(_ListEqAll([1, 2])))
    assert type(copied) is list and copied == [1, 2] and copied != [1]
    assert wire.decode(wire.encode(collections.Counter("aab"))) == {"a": 2, "b": 1}
    with pytest.raises(TypeError, match="not plain data"):
        wire.encode(object())
    deep = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(ValueError, match="nested deeper"):
        wire.encode(deep)


@pytest.mark.parametrize(
    "tree",
    [["zz", 1], ["l", 1], ["d", [[1]]], ["i", 5], ["j", "a", 1], ["h", 1, "object", "X"], [], {"a": 1}],
)
def test_codec_rejects_malformed_trees(tree):
    with pytest.raises(ValueError, match="malformed"):
        wire.decode(tree)


def test_report_records_need_the_nonce():
    data, nonce = wire.make_job({"mode": "test_code"})
    assert json.loads(data)["nonce"] == nonce and len(nonce) == 32
    report = b"\n".join([json.dumps([nonce, "pass"]).encode(), json.dumps(["0" * 32, "pass"]).encode(),
                         b"PASS", b"[1, 2", json.dumps([nonce, "case", 0, ["ok", 1]]).encode()])
    assert wire.read_report(report, nonce) == [["pass"], ["case", 0, ["ok", 1]]]
    assert wire.read_report(report, "f" * 32) == []


@pytest.mark.parametrize(
    "got, want, equal",
    [
        (1, 1, True),
        (True, 1, False),
        (1, True, False),
        (1.0, 1, False),
        (1, 1.0, False),
        ("1", 1, False),
        (0.1 + 0.2, 0.3, True),
        (float("nan"), float("nan"), True),
        (1e-12, 0.0, True),
        (1.001, 1.0, False),
        ([1, 2], (1, 2), True),
        ([1, 2], [1, 2, 3], False),
        ([1, True], [1, 1], False),
        ({1, 2}, frozenset({2, 1}), True),
        ({1, 2}, {1.0, 2.0}, False),
        ({"a": [1.0]}, {"a": [1.0]}, True),
        ({1: "x"}, {1.0: "x"}, False),
        ({"a": 1}, {"a": 1, "b": 2}, False),
        (None, None, True),
        (None, 0, False),
        (b"x", "x", False),
        (Opaque("Any"), 4, False),
        (_IntEqAll(4), 5, False),
    ],
)
def test_strict_equal(got, want, equal):
    assert strict_equal(got, want) is equal


# ---- service ------------------------------------------------------------------------------------------


def test_service_survives_errors_hangs_and_deaths(user_module, caplog):
    """The 1 s timeout runs on a clock the test advances: until it does, no call can time out (however
    slowly a loaded host runs the others), and when it does only the hanging call is still in flight."""
    now = [0.0]
    cfg = RewardConfig(reward="arithmetic", num_workers=2, timeout_s=1.0, imports=(user_module,))
    with RewardService(cfg, clock=lambda: now[0]) as svc:
        svc.wait_ready()
        items = [
            ("37+85=", "122", {"answer": "122"}),
            ("37+85=", "121", {"answer": "122"}),
            ("p", "x", {"reward": f"{user_module}:boom"}),
            ("p", "x", {"reward": f"{user_module}:hang"}),
            ("p", "x", {"reward": f"{user_module}:die"}),
            ("p", "x", {"reward": f"{user_module}:not_a_number"}),
            ("p", "abcd", {"reward": "user_len"}),  # registered by decorator in the imported module
            ("p", "x", {"reward": "no_such_reward"}),
        ]
        for i, (prompt, completion, meta) in enumerate(items):
            svc.submit(i, prompt, completion, meta)
        results = _poll_until(svc, len(items) - 1)  # every call but the hanging one, clock standing still
        assert 3 not in {r.request_id for r in results}
        now[0] += cfg.timeout_s + 0.5
        results += _poll_until(svc, 1)
        got = [(r.reward, r.reason) for r in sorted(results, key=lambda r: r.request_id)]
        assert got == [
            (1.0, "ok"),
            (0.0, "ok"),
            (0.0, "error:RuntimeError"),
            (0.0, "timeout"),
            (0.0, "worker_died"),
            (0.0, "error:TypeError"),
            (pytest.approx(0.4), "ok"),
            (0.0, "error:KeyError"),
        ]
        # Still healthy: the replaced workers grade normally.
        assert svc.grade_batch([("2+2=", "4", {"answer": "4"})] * 20, timeout=60) == [1.0] * 20
        stats = svc.stats()
    assert stats["graded"] == 28 and stats["ok"] == 23
    assert stats["timeouts"] == 1 and stats["errors"]["worker_died"] == 1
    assert stats["worker_restarts"] == 2 and stats["workers_alive"] == 2
    assert "timeout" in caplog.text and "worker_died" in caplog.text


def _poll_until(svc, n, timeout_s=120):
    """The next `n` results (the real-time limit only guards against a hang)."""
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n:
        assert time.monotonic() < deadline, f"{len(out)} of {n} results after {timeout_s} s: {out}"
        svc.wait(0.5)
        out += svc.poll()
    assert len(out) == n, out
    return out


def test_service_submit_poll_and_backpressure(user_module):
    cfg = RewardConfig(reward=f"{user_module}:slow", num_workers=1, timeout_s=10.0, max_queue=2)
    svc = RewardService(cfg)
    try:
        svc.wait_ready()
        submitted, full = 0, False
        for i in range(6):
            try:
                svc.submit(i, "p", "c", {}, block=False)
                submitted += 1
            except QueueFull:
                full = True
                break
        assert full and submitted <= 3  # at most 2 queued + 1 in flight
        assert svc.stats()["queue_depth"] <= 2
        svc.submit(99, "p", "c", {}, block=True, timeout=10)  # blocks until a slot frees, then queues
        results = []
        deadline = time.monotonic() + 30
        while len(results) < submitted + 1 and time.monotonic() < deadline:
            results += svc.poll()
            time.sleep(0.05)
        assert sorted(r.request_id for r in results) == [*range(submitted), 99]
        assert all(r.reward == 1.0 and r.elapsed_s >= 0.3 for r in results)
        assert svc.poll() == []
    finally:
        svc.close()
    with pytest.raises(RuntimeError, match="closed"):
        svc.submit(0, "p", "c", {})


def test_service_start_fails_on_what_a_worker_could_not_load():
    cfg = RewardConfig(reward="registered_by_import", imports=("no_such_reward_module_xyz",))  # no import yet
    with pytest.raises(ModuleNotFoundError, match="no_such_reward_module_xyz"):
        RewardService(cfg)
    with pytest.raises(AttributeError, match="no_such_fn"):
        RewardService(RewardConfig(reward="jaxrl_async.rewards.math:no_such_fn"))
