"""Code reward: run the completion's program against test cases in the sandbox."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from jaxrl_async.rewards.registry import Graded, register_reward
from jaxrl_async.rewards.sandbox import SandboxLimits, run_python

_FENCE_RE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


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


@register_reward("code")
def code_reward(prompt: str, completion: str, metadata: Mapping[str, Any]) -> Graded:
    """Fraction of test cases passed by the completion's program.

    metadata:
      tests: list of {"input": stdin text, "output": expected stdout}; each runs in a fresh sandbox.
      test_code: Python appended to the program (e.g. asserts); passes when the program exits 0.
      sandbox: optional SandboxLimits overrides, e.g. {"timeout_s": 2}.
      stop_on_failure: stop at the first failing case (default True; later cases then count as failed).
    """
    limits = _limits(metadata)
    program = extract_program(completion)
    cases = [(str(t.get("input", "")), str(t["output"]), None) for t in metadata.get("tests", ())]
    if metadata.get("test_code"):
        cases.append(("", None, str(metadata["test_code"])))
    if not cases:
        raise ValueError("code reward: metadata has neither 'tests' nor 'test_code'")
    passed, notes = 0, []
    for stdin, want, test_code in cases:
        code = program if test_code is None else f"{program}\n\n{test_code}\n"
        res = run_python(code, stdin, limits)
        ok = res.ok and (want is None or _same_output(res.stdout, want))
        passed += ok
        if not ok:
            notes.append(res.status if not res.ok else "wrong_output")
            if metadata.get("stop_on_failure", True):
                break
    info = f"passed {passed}/{len(cases)}" + (f"; first failure: {notes[0]}" if notes else "")
    return Graded(passed / len(cases), info)
