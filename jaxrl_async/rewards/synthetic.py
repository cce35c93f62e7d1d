"""Verifiers of the built-in synthetic tasks (jaxrl_async.data's "arithmetic", "countdown", "shift",
"letter_range" and "calc_tool").

They read the problem from the prompt's metadata, never from its text: arithmetic and shift compare
with metadata["answer"], countdown checks against metadata["numbers"] and metadata["target"], letter
range rebuilds its answer from metadata["first"] and metadata["last"], calc_tool recomputes it from
metadata["expression"]. A request without them is an
error (reward 0 with reason "error:KeyError"; bounds that are no letters: "error:ValueError").
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from jaxrl_async.letters import letter_range  # the generator's own span rule (data imports it too)
from jaxrl_async.rewards.registry import register_reward

_EXPR_CHARS = set("0123456789+-*/() ")
_MAX_EXPR_LEN = 200


@register_reward("arithmetic")
def arithmetic_reward(prompt: str, completion: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the stripped completion is exactly metadata["answer"]."""
    return 1.0 if completion.strip() == str(metadata["answer"]) else 0.0


def _eval_node(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult, ast.Div):
        a, b = _eval_node(node.left, used), _eval_node(node.right, used)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if b == 0:
            raise ZeroDivisionError
        return a / b
    raise ValueError(f"disallowed syntax {type(node).__name__}")


def countdown_verify(expression: str, numbers: Sequence[int], target: int) -> bool:
    """True when `expression` uses each of `numbers` exactly once (+ - * / and parentheses) and equals
    `target` (exact rational arithmetic)."""
    expr = expression.strip()
    if not expr or len(expr) > _MAX_EXPR_LEN or set(expr) - _EXPR_CHARS:
        return False
    try:
        used: list[int] = []
        value = _eval_node(ast.parse(expr, mode="eval").body, used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return False
    return sorted(used) == sorted(numbers) and value == target


@register_reward("countdown")
def countdown_reward(prompt: str, completion: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the completion is a valid expression over metadata["numbers"] reaching metadata["target"]."""
    numbers, target = list(metadata["numbers"]), int(metadata["target"])
    return 1.0 if countdown_verify(completion, numbers, target) else 0.0


@register_reward("shift")
def shift_reward(prompt: str, completion: str, metadata: Mapping[str, Any]) -> float:
    """The share of answer positions right: matching characters / max(len(answer), len(completion)), so
    1.0 only for the exact answer (held-out accuracy counts reward >= 1) and a long answer that is
    mostly right still carries a learning signal within its group."""
    answer, got = str(metadata["answer"]), completion.strip()
    hits = sum(a == b for a, b in zip(answer, got, strict=False))
    return hits / max(len(answer), len(got), 1)


@register_reward("letter_range")
def letter_range_reward(prompt: str, completion: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the stripped completion is exactly the range metadata["first"] to metadata["last"], else 0.

    Exact, not shift's share of positions right: with partial credit, RL from the warm start lost held-out
    accuracy (0.315 -> 0.125 in 60 steps of configs/letter_range.py; its completions got shorter), with
    this reward it gained (0.315 -> 0.45 in 100 steps)."""
    return 1.0 if completion.strip() == letter_range(str(metadata["first"]), str(metadata["last"])) else 0.0


_RESULT_CLOSE = "</result>"  # the tool-call formats' result marker (jaxrl_async.envs.calls)


def _calc_value(expression: str) -> int:
    """The exact value of a calc_tool expression "a*b" or "a*b+c" (digits only: anything else raises)."""
    product, _, added = expression.partition("+")
    a, b = product.split("*")
    return int(a) * int(b) + (int(added) if added else 0)


@register_reward("calc_tool")
def calc_tool_reward(prompt: str, completion: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the episode's final answer is exactly metadata["expression"]'s value, else 0.

    The final answer is the text after the last `</result>` (the whole completion when a single turn was
    graded): an episode's earlier calls and the results they read are not the answer, and a last turn
    that is itself a call ("<tool ...") answered nothing. The value is recomputed from the expression,
    not read from metadata["answer"], so a row cannot carry a wrong reference."""
    final = completion.rpartition(_RESULT_CLOSE)[2].strip()
    return 1.0 if final == str(_calc_value(str(metadata["expression"]))) else 0.0
