"""The calculator task: products a tiny model cannot compute in its head but can read off the calculator.

Prompt "What is 347*29?" (a has `DataConfig.digits` digits, b two), answer "10063". A quarter of the rows
add a number, "What is 347*29+512?", solved in two calls: the product first, then the sum with the
product the first call returned. The reference episode (the supervised warm start's, `reference_segments`)
with the "tags" format (`jaxrl_async.envs.calls`):

    What is 347*29+512?                                 prompt
    <tool name=calculator>347*29</tool><eos>            model turn 1
    <result>10063</result>                              observation (the calculator's answer)
    <tool name=calculator>10063+512</tool><eos>         model turn 2
    <result>10575</result>                              observation
    10575<eos>                                          model turn 3: the answer

Why this task needs the tool: a 4-5 digit product is one of ~80,000 and a character model of a few hundred
thousand parameters neither memorizes them nor learns long multiplication from a few minutes of data, so
without the calculator's result it answers almost never right; with it the answer is a copy of the last
result. The warm start trains on the model turns only (the observations are masked out of its loss,
`trainer.warmstart.make_sft_batch`), so it teaches when and how to call and to copy the result back, never a
product. The calculator takes a whole expression, so a policy may also reach a two-call row's answer in one
call ("347*29+512"); the reference splits it so that the model learns to use a result in a later call.

Rows are a deterministic function of (seed, split, index); a stable hash of the expression puts each
problem in exactly one split, so no training row equals a held-out one. Metadata carries "expression"
(what the verifier recomputes the answer from, `rewards.synthetic.calc_tool_reward`) and "calls" (the
reference calls).
"""

from __future__ import annotations

import random
import re
from typing import Any

from jaxrl_async.data.prompt import DataConfig, is_heldout

TOOL = "calculator"  # the tool the reference episodes call (jaxrl_async.envs.tools)
TWO_CALL_SHARE = 0.25  # rows "a*b+c", two calls in the reference
SECOND_DIGITS = 2  # digits of b: a product of 3 x 2 digits has 4-5, beyond a tiny model's head

_PROMPT_RE = re.compile(r"What is (\d+)\*(\d+)(?:\+(\d+))?\?")


def calc_tool_problem(a: int, b: int, c: int | None = None) -> tuple[str, str, list[str]]:
    """(prompt, answer, reference calls), e.g. (347, 29) -> ("What is 347*29?", "10063", ["347*29"])."""
    if c is None:
        return f"What is {a}*{b}?", str(a * b), [f"{a}*{b}"]
    return f"What is {a}*{b}+{c}?", str(a * b + c), [f"{a}*{b}", f"{a * b}+{c}"]


def parse_calc_tool(prompt: str) -> tuple[int, int, int | None] | None:
    """(a, b, c or None) of the last problem in `prompt`, or None when it holds none."""
    m = _PROMPT_RE.findall(prompt)
    if not m:
        return None
    a, b, c = m[-1]
    return int(a), int(b), (int(c) if c else None)


def _draw(rng: random.Random, digits: int) -> tuple[int, int, int | None]:
    lo = 10 ** (digits - 1) if digits > 1 else 0
    a = rng.randrange(lo, 10**digits)
    b = rng.randrange(10 ** (SECOND_DIGITS - 1), 10**SECOND_DIGITS)
    c = rng.randrange(lo, 10**digits) if rng.random() < TWO_CALL_SHARE else None
    return a, b, c


def _record(split: str, uid: str, a: int, b: int, c: int | None) -> dict[str, Any]:
    prompt, answer, calls = calc_tool_problem(a, b, c)
    expression = prompt[len("What is ") : -1]
    meta = {"expression": expression, "calls": calls}
    return {"uid": uid, "prompt": prompt, "answer": answer, "metadata": meta}


def calc_tool_example(cfg: DataConfig, split: str, index: int) -> dict[str, Any]:
    """The `index`-th record of `split` ("train" or "test"): a deterministic function of (seed, split,
    index); a problem is in exactly one split (by a stable hash of its expression)."""
    rng = random.Random(f"calc_tool:{cfg.seed}:{split}:{index}")
    while True:
        a, b, c = _draw(rng, cfg.digits)
        expression = calc_tool_problem(a, b, c)[0]
        if is_heldout(expression, cfg.heldout_fraction) == (split == "test"):
            return _record(split, f"calc_tool:{split}:{index}", a, b, c)


def calc_tool_distinct(cfg: DataConfig, n: int, split: str = "test") -> list[dict[str, Any]]:
    """`n` distinct records of `split` in a fixed order (the problem space is far larger than any
    held-out set, so drawing and skipping repeats is enough). Their uids name the problem, so the same
    problem has the same uid whatever its position."""
    out, seen = [], set()
    for i in range(50 * n + 1000):
        rec = calc_tool_example(cfg, split, i)
        if rec["prompt"] not in seen:
            seen.add(rec["prompt"])
            out.append({**rec, "uid": f"calc_tool:{split}:{rec['metadata']['expression']}"})
            if len(out) == n:
                break
    return out


def reference_segments(prompt: str, tool: str = TOOL) -> list[tuple[str, bool]]:
    """The reference episode after `prompt` as (text, is_model_turn) segments in order: each call turn,
    the calculator's observation, and the answer turn (see the module docstring). A model turn ends with
    the tokenizer's stop token, which the caller appends; observations are exactly what `envs.ToolEnv`
    writes back ("tags" format).

    Raises:
      ValueError: `prompt` holds no calculator problem.
    """
    parsed = parse_calc_tool(prompt)
    if parsed is None:
        raise ValueError(f"not a calc_tool prompt: {prompt!r}")
    _, answer, calls = calc_tool_problem(*parsed)
    segments: list[tuple[str, bool]] = []
    for call in calls:
        segments.append((f"<tool name={tool}>{call}</tool>", True))
        segments.append((f"<result>{_value(call)}</result>", False))
    segments.append((answer, True))
    return segments


def _value(call: str) -> str:
    """What the calculator answers to a reference call ("a*b" or "p+c"): the same exact integer."""
    if "*" in call:
        x, y = call.split("*")
        return str(int(x) * int(y))
    x, y = call.split("+")
    return str(int(x) + int(y))
