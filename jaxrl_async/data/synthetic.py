"""Built-in tasks needing no files: multi-digit arithmetic and countdown, with solvers and a held-out split.

Both use only characters in `tokenizer.CHAR_VOCAB`. Examples are generated from (seed, split, index) so a
dataset is lazy, deterministic and indexable; the held-out split is a stable hash of the problem, so no
train example ever equals a held-out one.

Arithmetic: prompt "37+85=", completion "122" (most significant digit first); metadata carries "answer".
Countdown: prompt "make 24 with 3 5 8:", completion an expression using each number exactly once with
+ - * / and parentheses (e.g. "(8-5)*8"); metadata carries "numbers" and "target".
Shift: prompt "shift 40913:" (`digits` random digits), completion every digit plus one mod 10 ("51024"):
answers as long as `digits` (tens of tokens), so that weight updates land in the middle of sequences,
yet learnable by a tiny model (each answer token copies one prompt token, shifted); metadata carries
"answer". Letter range (jaxrl_async.data.letter_range): prompt "range d-k:", completion "defghijk", with
long-tailed answer lengths. Calculator (jaxrl_async.data.calc_tool): prompt "What is 347*29?", solved by
calling the calculator tool in a multi-turn episode. The verifiers that read that metadata are the
rewards "arithmetic", "countdown", "shift", "letter_range" and "calc_tool" (jaxrl_async.rewards.synthetic).
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from jaxrl_async.data.calc_tool import calc_tool_distinct, calc_tool_example, parse_calc_tool
from jaxrl_async.data.letter_range import (
    letter_range_distinct,
    letter_range_example,
    letter_range_problem,
    parse_letter_range,
)
from jaxrl_async.data.prompt import DataConfig, is_heldout, unit_hash

_ARITH_RE = re.compile(r"(\d+)([+\-*])(\d+)=")
_COUNTDOWN_RE = re.compile(r"make (\d+) with ([\d ]+):")
_SHIFT_RE = re.compile(r"shift (\d+):")
_ENUMERATE_LIMIT = 200_000  # problem spaces up to this size are enumerated for a duplicate-free held-out set
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


# ---- arithmetic ---------------------------------------------------------------------------------------


def arithmetic_problem(a: int, op: str, b: int) -> tuple[str, str]:
    """(prompt, answer) for `a op b`, e.g. (37, "+", 85) -> ("37+85=", "122")."""
    return f"{a}{op}{b}=", str(_OPS[op](a, b))


def _arithmetic_draw(cfg: DataConfig, split: str, index: int) -> tuple[int, str, int]:
    rng = random.Random(f"arithmetic:{cfg.seed}:{split}:{index}")
    hi = 10**cfg.digits
    while True:
        a, op, b = rng.randrange(hi), rng.choice(cfg.operators), rng.randrange(hi)
        if is_heldout(f"{a}{op}{b}", cfg.heldout_fraction) == (split == "test"):
            return a, op, b


def arithmetic_example(cfg: DataConfig, split: str, index: int) -> dict[str, Any]:
    """The `index`-th arithmetic example of `split` ("train" or "test") as a raw record."""
    a, op, b = _arithmetic_draw(cfg, split, index)
    prompt, answer = arithmetic_problem(a, op, b)
    return {"uid": f"arithmetic:{split}:{index}", "prompt": prompt, "answer": answer, "metadata": {}}


def _arithmetic_distinct(cfg: DataConfig, n: int, split: str) -> list[dict[str, Any]]:
    hi = 10**cfg.digits
    if hi * hi * len(cfg.operators) > _ENUMERATE_LIMIT:
        return _sample_unique(lambda i: arithmetic_example(cfg, split, i), n)
    keys = [
        (a, op, b)
        for a, op, b in itertools.product(range(hi), cfg.operators, range(hi))
        if is_heldout(f"{a}{op}{b}", cfg.heldout_fraction) == (split == "test")
    ]
    keys.sort(key=lambda k: unit_hash(f"order:{cfg.seed}:{k}"))
    out = []
    for a, op, b in keys[:n]:
        prompt, answer = arithmetic_problem(a, op, b)
        uid = f"arithmetic:{split}:{a}{op}{b}"
        out.append({"uid": uid, "prompt": prompt, "answer": answer, "metadata": {}})
    return out


# ---- countdown ----------------------------------------------------------------------------------------


def _combine(rng: random.Random, items: list[tuple[str, Fraction]]) -> tuple[str, Fraction] | None:
    """Folds the numbers into one random expression with integer, positive intermediates."""
    items = list(items)
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (ea, va), (eb, vb) = items[i], items[j]
        op = rng.choice("+-*/")
        if op == "-" and va <= vb or op == "/" and (vb == 0 or va % vb != 0):
            op = "+" if rng.random() < 0.5 else "*"
        value = {"+": va + vb, "-": va - vb, "*": va * vb, "/": va / vb if vb else None}[op]
        wrap = lambda e: e if e.isdigit() else f"({e})"
        items = [x for k, x in enumerate(items) if k not in (i, j)] + [(f"{wrap(ea)}{op}{wrap(eb)}", value)]
    return items[0]


def countdown_problem(numbers: Sequence[int], target: int) -> str:
    """The prompt text, e.g. ([3, 5, 8], 24) -> "make 24 with 3 5 8:"."""
    return f"make {target} with {' '.join(map(str, numbers))}:"


def countdown_example(cfg: DataConfig, split: str, index: int) -> dict[str, Any]:
    """The `index`-th countdown puzzle of `split`; always solvable (built from a random expression)."""
    rng = random.Random(f"countdown:{cfg.seed}:{split}:{index}")
    while True:
        nums = [rng.randint(1, cfg.countdown_max_number) for _ in range(cfg.countdown_numbers)]
        expr, value = _combine(rng, [(str(x), Fraction(x)) for x in nums])
        if value.denominator != 1 or not 1 <= value <= cfg.countdown_max_target:
            continue
        target = int(value)
        if is_heldout(f"{sorted(nums)}->{target}", cfg.heldout_fraction) == (split == "test"):
            meta = {"numbers": nums, "target": target, "solution": expr}
            prompt = countdown_problem(nums, target)
            return {
                "uid": f"countdown:{split}:{index}",
                "prompt": prompt,
                "answer": str(target),
                "metadata": meta,
            }


def _parse_countdown(prompt: str) -> tuple[list[int], int]:
    m = _COUNTDOWN_RE.findall(prompt)
    if not m:
        raise ValueError(f"not a countdown prompt: {prompt!r}")
    target, nums = m[-1]
    return [int(x) for x in nums.split()], int(target)


def solve_countdown(numbers: Sequence[int], target: int) -> str | None:
    """An expression using every number once that equals `target`, or None (exhaustive search)."""
    seen: set[tuple] = set()

    def search(items: list[tuple[Fraction, str]]) -> str | None:
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        key = tuple(sorted(v for v, _ in items))
        if key in seen:
            return None
        seen.add(key)
        for i, j in itertools.permutations(range(len(items)), 2):
            (va, ea), (vb, eb) = items[i], items[j]
            rest = [x for k, x in enumerate(items) if k not in (i, j)]
            cands = [(va + vb, "+"), (va - vb, "-"), (va * vb, "*")] + ([(va / vb, "/")] if vb else [])
            for value, op in cands:
                found = search([*rest, (value, f"({ea}{op}{eb})")])
                if found:
                    return found
        return None

    expr = search([(Fraction(x), str(x)) for x in numbers])
    return expr[1:-1] if expr and expr.startswith("(") and expr.endswith(")") and len(numbers) > 1 else expr


# ---- shift --------------------------------------------------------------------------------------------


def shift_problem(digits: str) -> tuple[str, str]:
    """(prompt, answer) for a digit string, e.g. "40913" -> ("shift 40913:", "51024")."""
    return f"shift {digits}:", "".join(str((int(d) + 1) % 10) for d in digits)


def shift_example(cfg: DataConfig, split: str, index: int) -> dict[str, Any]:
    """The `index`-th shift example of `split`: `cfg.digits` uniform random digits."""
    rng = random.Random(f"shift:{cfg.seed}:{split}:{index}")
    while True:
        digits = "".join(rng.choice("0123456789") for _ in range(cfg.digits))
        if is_heldout(digits, cfg.heldout_fraction) == (split == "test"):
            prompt, answer = shift_problem(digits)
            return {"uid": f"shift:{split}:{index}", "prompt": prompt, "answer": answer, "metadata": {}}


# ---- shared -------------------------------------------------------------------------------------------


def reference_completion(prompt: str) -> str:
    """The correct completion text for an arithmetic, countdown, shift or letter-range prompt (supervised
    warm starts). A calc_tool prompt has none: its reference is a multi-turn episode with the calculator's
    answers in it (`jaxrl_async.data.calc_tool.reference_segments`)."""
    if parse_calc_tool(prompt) is not None:
        raise ValueError(
            f"calc_tool prompt {prompt!r} has a reference episode, not a completion: "
            "jaxrl_async.data.calc_tool.reference_segments"
        )
    bounds = parse_letter_range(prompt)
    if bounds:
        return letter_range_problem(*bounds)[1]
    m = _SHIFT_RE.findall(prompt)
    if m:
        return shift_problem(m[-1])[1]
    m = _ARITH_RE.findall(prompt)
    if m:
        a, op, b = m[-1]
        return arithmetic_problem(int(a), op, int(b))[1]
    numbers, target = _parse_countdown(prompt)
    expr = solve_countdown(numbers, target)
    if expr is None:
        raise ValueError(f"countdown prompt has no solution: {prompt!r}")
    return expr


def synthetic_example(cfg: DataConfig, split: str, index: int) -> dict[str, Any]:
    """The `index`-th raw record of a synthetic task's split."""
    tasks = {"arithmetic": arithmetic_example, "shift": shift_example, "letter_range": letter_range_example,
             "calc_tool": calc_tool_example}  # fmt: skip
    fn = tasks.get(cfg.task, countdown_example)
    return fn(cfg, split, index)


def synthetic_distinct(cfg: DataConfig, n: int, split: str = "test") -> list[dict[str, Any]]:
    """`n` distinct records of `split` (fewer if its space is smaller), in a fixed order: the held-out set
    ("test"), or the training split's problems scored the same way ("train")."""
    if cfg.task == "arithmetic":
        return _arithmetic_distinct(cfg, n, split)
    if cfg.task == "letter_range":
        return letter_range_distinct(cfg, n, split)
    if cfg.task == "calc_tool":
        return calc_tool_distinct(cfg, n, split)
    return _sample_unique(lambda i: synthetic_example(cfg, split, i), n)


def _sample_unique(draw, n: int) -> list[dict[str, Any]]:
    out, seen = [], set()
    for i in range(50 * n + 1000):
        rec = draw(i)
        if rec["prompt"] not in seen:
            seen.add(rec["prompt"])
            out.append(rec)
            if len(out) == n:
                break
    return out
