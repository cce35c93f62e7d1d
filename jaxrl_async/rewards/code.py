"""Code reward: run the completion's program against test cases in the sandbox.

Three kinds of test, in any mix; each stdin/stdout test, each structured case and the `test_code` block
count as one unit, and the reward is the fraction of units passed:
  * `tests` (stdin/stdout): the program is the main program; its output is compared with the expected
    output. Exit status alone never passes a test.
  * `cases` (structured): the grading harness loads the program as a module and calls `entry_point`
    with each case's arguments; the results come back as plain data and are compared here, outside the
    sandbox, by `strict_equal` (type-checked, never the program's `__eq__`).
  * `test_code` (asserts): the harness's judge runs the test code, reaching the program's names only
    through requests (see harness.py), and reports a pass with the run's nonce only if it ran to the
    end without an exception.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from jaxrl_async.rewards.registry import Graded, register_reward
from jaxrl_async.rewards.sandbox import SandboxLimits, run_harness, run_python, wire

_FENCE_RE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
_DEFAULT_FLOAT_TOL = 1e-9


def extract_program(completion: str) -> str:
    """The last fenced code block (```python ... ```), or the whole completion when there is none."""
    blocks = _FENCE_RE.findall(completion)
    return blocks[-1] if blocks else completion


def _limits(metadata: Mapping[str, Any]) -> SandboxLimits:
    overrides = dict(metadata.get("sandbox", {}))
    unknown = set(overrides) - {f.name for f in dataclasses.fields(SandboxLimits)}
    if unknown:
        raise ValueError(f"code reward: unknown sandbox limits {sorted(unknown)}")
    return SandboxLimits(**overrides)


def _same_output(got: str, want: str) -> bool:
    # Trailing whitespace per line and trailing blank lines are not part of the answer.
    norm = lambda s: "\n".join(line.rstrip() for line in s.strip().splitlines())
    return norm(got) == norm(want)


class Opaque:
    """A value the program returned that is not plain data (e.g. an instance of its own class); it
    equals nothing."""

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __repr__(self):
        return f"<{self.type_name} object>"


def _key(x):
    """A hashable, type-tagged form of a plain value for set elements and dict keys (so that 1, 1.0 and
    True stay distinct, as `strict_equal` wants)."""
    t = type(x)
    if t in (list, tuple):
        return ("seq", tuple(_key(v) for v in x))
    if t in (set, frozenset):
        return ("set", frozenset(_key(v) for v in x))
    return (t.__name__, x)


def strict_equal(got, want, float_tol: float = _DEFAULT_FLOAT_TOL) -> bool:
    """Type-checked equality of plain values that never calls a method of the compared objects.

    Rules: types must match exactly (1 != 1.0 != True, "1" != 1), except that list and tuple are both
    sequences (JSON cannot tell them apart) and set and frozenset are both sets. Floats (and complex
    parts) match within `float_tol`, relative or absolute (math.isclose); NaN matches NaN. Dicts match
    when their keys match exactly (type-tagged) and their values match by these rules. Anything else,
    e.g. an `Opaque` value, matches nothing.
    """
    tg, tw = type(got), type(want)
    if tw in (list, tuple):
        return (tg in (list, tuple) and len(got) == len(want)
                and all(strict_equal(g, w, float_tol) for g, w in zip(got, want, strict=True)))
    if tw in (set, frozenset):
        return tg in (set, frozenset) and {_key(v) for v in got} == {_key(v) for v in want}
    if tw is dict:
        if tg is not dict or len(got) != len(want):
            return False
        got_by_key = {_key(k): v for k, v in got.items()}
        return all(_key(k) in got_by_key and strict_equal(got_by_key[_key(k)], v, float_tol)
                   for k, v in want.items())
    if tg is not tw or tw not in (type(None), bool, int, float, complex, str, bytes):
        return False
    if tw is float:
        return (math.isnan(got) and math.isnan(want)) or math.isclose(got, want, rel_tol=float_tol,
                                                                       abs_tol=float_tol)
    if tw is complex:
        return strict_equal(got.real, want.real, float_tol) and strict_equal(got.imag, want.imag, float_tol)
    return got == want


def _plain(value, where: str):
    """`value` encoded for the harness; a ValueError naming `where` when it is not plain data."""
    try:
        return wire.encode(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"code reward: {where} is not plain data ({e})") from e


def _parse_cases(metadata: Mapping[str, Any]) -> tuple[str, list, list]:
    """(entry_point, [[encoded args, encoded kwargs], ...], [expected, ...]) from metadata["cases"]."""
    entry = metadata.get("entry_point")
    if not isinstance(entry, str) or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?", entry):
        raise ValueError(f"code reward: 'cases' needs entry_point 'name' or 'Class.method', got {entry!r}")
    calls, expected = [], []
    for i, case in enumerate(metadata["cases"]):
        if not isinstance(case, Mapping) or "expected" not in case:
            raise ValueError(f"code reward: cases[{i}] must be a mapping with 'expected'")
        args, kwargs = case.get("args", []), case.get("kwargs", {})
        if not isinstance(args, list | tuple) or not isinstance(kwargs, Mapping):
            raise ValueError(f"code reward: cases[{i}].args must be a list and .kwargs a mapping")
        if not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
            raise ValueError(f"code reward: cases[{i}].kwargs keys must be argument names")
        _plain(case["expected"], f"cases[{i}].expected")
        calls.append([_plain(list(args), f"cases[{i}].args"), _plain(dict(kwargs), f"cases[{i}].kwargs")])
        expected.append(case["expected"])
    return entry, calls, expected


def _float_tol(metadata: Mapping[str, Any]) -> float:
    tol = metadata.get("float_tol", _DEFAULT_FLOAT_TOL)
    if isinstance(tol, bool) or not isinstance(tol, int | float) or not 0 <= tol < 1:
        raise ValueError(f"code reward: float_tol must be a number in [0, 1), got {tol!r}")
    return float(tol)


def _run_cases(program, cases, tol, limits) -> list[tuple[bool, str]]:
    entry, calls, expected = cases
    res = run_harness(program, {"mode": "calls", "entry_point": entry, "calls": calls}, limits)
    results = {rec[1]: rec[2] for rec in res.records if rec[0] == "case" and len(rec) == 3}
    fail = next((rec[1] for rec in res.records if rec[0] == "fail" and len(rec) == 2), None)
    outcomes = []
    for i, want in enumerate(expected):
        rec = results.get(i)
        if rec is None:
            outcomes.append((False, str(fail or _why_no_report(res.run))))
        elif rec[0] == "raise":
            outcomes.append((False, f"case {i} raised {rec[1]}: {rec[2]}"[:200]))
        else:
            got = wire.decode(rec[1], lambda tree: Opaque(str(tree[3])))
            ok = strict_equal(got, want, tol)
            outcomes.append((ok, "" if ok else f"case {i}: wrong value {got!r}"[:200]))
    return outcomes


def _why_no_report(run) -> str:
    if run.status != "ok":
        return run.status
    return "no_report" + (f": {run.stderr.strip().splitlines()[-1][:150]}" if run.stderr.strip() else "")


def _run_test_code(program, test_code, limits) -> tuple[bool, str]:
    res = run_harness(program, {"mode": "test_code", "test_code": test_code}, limits)
    kinds = {rec[0]: rec for rec in res.records}
    if "pass" in kinds:
        return True, ""
    if "fail" in kinds and len(kinds["fail"]) == 2:
        return False, f"test_code: {kinds['fail'][1]}"[:200]
    return False, _why_no_report(res.run)


@register_reward("code")
def code_reward(prompt: str, completion: str, metadata: Mapping[str, Any]) -> Graded:
    """Fraction of test units passed by the completion's program (see the module docstring).

    metadata:
      tests: list of {"input": stdin text, "output": expected stdout}; each runs in a fresh sandbox.
      cases: list of {"args": [...], "kwargs": {...}, "expected": value} (plain data); all run in one
        sandbox and compare with `strict_equal`.
      entry_point: what `cases` call: a function "f", or "Class.method" (Class() made for each case).
      float_tol: tolerance of float results in `cases` (default 1e-9, relative or absolute).
      test_code: Python asserts run against the program's names by the harness's judge.
      sandbox: optional SandboxLimits overrides, e.g. {"timeout_s": 2}; the timeout covers one run.
      stop_on_failure: stop at the first failing unit (default True; later units then count as failed).
    """
    limits = _limits(metadata)
    program = extract_program(completion)
    tests = [(str(t.get("input", "")), str(t["output"])) for t in metadata.get("tests", ())]
    n_cases = len(metadata.get("cases", ()))
    test_code = str(metadata.get("test_code") or "")
    total = len(tests) + n_cases + bool(test_code)
    if not total:
        raise ValueError("code reward: metadata has none of 'tests', 'cases' or 'test_code'")
    stop = metadata.get("stop_on_failure", True)
    cases = _parse_cases(metadata) if n_cases else None  # bad cases fail before anything runs
    tol = _float_tol(metadata)
    outcomes: list[tuple[bool, str]] = []
    for stdin, want in tests:
        res = run_python(program, stdin, limits)
        ok = res.ok and _same_output(res.stdout, want)
        outcomes.append((ok, "" if ok else (res.status if not res.ok else "wrong_output")))
        if not ok and stop:
            break
    if n_cases and not (stop and not all(ok for ok, _ in outcomes)):
        outcomes += _run_cases(program, cases, tol, limits)
    if test_code and not (stop and not all(ok for ok, _ in outcomes)):
        outcomes.append(_run_test_code(program, test_code, limits))
    passed = 0
    for ok, _ in outcomes:
        if not ok and stop:
            break
        passed += ok
    failures = [why for ok, why in outcomes if not ok]
    info = f"passed {passed}/{total}" + (f"; first failure: {failures[0]}" if failures else "")
    return Graded(passed / total, info)
