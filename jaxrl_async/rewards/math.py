"""Math answer equivalence with math-verify, and an optional format reward.

The answer rule (what `math_reward` grades):
  1. The final answer is the last `\\boxed{}` (or `\\fbox{}`); without one, the last `<answer>..</answer>`;
     without one, the text after the last `####`; without any marker, math-verify's own search of the
     completion.
  2. Which marked answers count is the answer rule, metadata["answer_rule"] (`RewardConfig.answer_rule`):
     "last" (the default, the common convention): only the final answer is graded, so a completion that
     corrects itself ("first \\boxed{5}, then corrected: \\boxed{7}") scores on the 7, and listing several
     answers gains nothing (only the last is read). "agree": every other boxed answer (or answer tag)
     must be equivalent to the final one; a completion with several different answers scores 0
     (`conflicting_answers`), even when the last is right, and more than `MAX_ANSWERS` distinct marked
     answers score 0 (`too_many_answers`).
  3. The final answer must be the same kind of object as the reference: a single value for a single
     value (a set, an interval, a tuple, an inequality or a chain of unequal values is `not_a_single_value`),
     a set for a set, an interval for an interval. Within a box, `\\\\` line breaks (outside matrix
     environments), `\\vee`, `\\lor`, `\\cup`, `\\wedge` and `\\land` also make several answers of one.
  4. Then math-verify decides equivalence (`\\frac{1}{2}` = `0.5`, `2\\sqrt{2}` = `\\sqrt{8}`, ...).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from jaxrl_async.rewards.answers import ANSWER_RULES, extract_boxed, reference_answer
from jaxrl_async.rewards.registry import Graded, register_reward

MAX_ANSWERS = 8
_ANSWER_TAG_RE = re.compile(r"<answer>(.+?)</answer>", re.DOTALL)
_FORMAT_RE = re.compile(r"(\\boxed\{.+\}|####\s*\S|<answer>.+?</answer>)", re.DOTALL)
_MATRIX_ENV_RE = re.compile(r"\\begin\{([pbvBV]?matrix|array|smallmatrix)\}.*?\\end\{\1\}", re.DOTALL)
_JOINERS_RE = re.compile(r"\\\\|\\vee\b|\\lor\b|\\cup\b|\\wedge\b|\\land\b")


def _boxed_answers(text: str) -> list[str]:
    """Contents of every balanced `\\boxed{...}` / `\\fbox{...}`, in order."""
    out = []
    while True:
        start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
        if start < 0:
            return out[::-1]
        content = extract_boxed(text[start:])
        if content is not None:
            out.append(content)
        text = text[:start]


def marked_answers(completion: str) -> tuple[list[str], bool]:
    """(the completion's marked answers as LaTeX for math-verify, in order; whether any was marked).
    The last one is the final answer; with no marker it is the whole completion."""
    boxed = _boxed_answers(completion)
    if boxed:
        return [f"\\boxed{{{b}}}" for b in boxed], True
    tagged = _ANSWER_TAG_RE.findall(completion)
    if tagged:
        return [f"${t.strip()}$" for t in tagged], True
    if "####" in completion:
        return [completion.rsplit("####", 1)[1].strip().replace(",", "")], True
    return [completion], False


def _parse_gold(answer: str):
    from math_verify import parse

    parsed = parse(answer) if "$" in answer or "\\boxed" in answer else []
    # A bare reference answer ("3/4", "\\frac{1}{2}") parses most reliably as inline LaTeX.
    return parsed or parse(f"${answer}$") or parse(answer)


def _constant_sides_agree(eqs) -> bool:
    """True when the symbol-free sides of a chain `a = b = c` are all equal (`x = 6/4 = 3/2` is one
    value; `3 = x = 4` is two)."""
    import sympy

    consts = [s for eq in eqs for s in (eq.lhs, eq.rhs) if not s.free_symbols]
    return all(sympy.simplify(c - consts[0]) == 0 for c in consts[1:])


def answer_kind(parsed: list) -> str:
    """value | set | tuple | matrix | relation | conflict: what a math-verify parse denotes."""
    import sympy

    obj = next((p for p in parsed if not isinstance(p, str)), None)
    if obj is None:
        return "value"
    if isinstance(obj, sympy.Eq):
        if obj.lhs.free_symbols or isinstance(obj.lhs, sympy.Function):
            return answer_kind([obj.rhs])  # "x = 3": a labelled value
        return "value" if _constant_sides_agree([obj]) else "conflict"
    if isinstance(obj, sympy.And) and all(isinstance(a, sympy.Eq) for a in obj.args):
        return "value" if _constant_sides_agree(obj.args) else "conflict"
    if isinstance(obj, sympy.FiniteSet | sympy.Tuple | tuple | list) and len(obj) == 1:
        return answer_kind([next(iter(obj))])
    if isinstance(obj, sympy.Set):
        return "set"
    if isinstance(obj, sympy.Tuple | tuple | list):
        return "tuple"
    if isinstance(obj, sympy.MatrixBase):
        return "matrix"
    if isinstance(obj, sympy.logic.boolalg.Boolean):
        return "relation"
    return "value"


def grade_math(completion: str, answer: str, rule: str = "last") -> Graded:
    """1.0 when the completion's final answer follows the module's answer rule (`rule`: "last" or
    "agree") and equals `answer` mathematically; 0.0 with the reason in `info` otherwise.

    Raises:
      ValueError: `rule` is not one of ANSWER_RULES.
    """
    from math_verify import parse, verify

    if rule not in ANSWER_RULES:
        raise ValueError(f"answer_rule must be one of {ANSWER_RULES}, got {rule!r}")
    answers, marked = marked_answers(completion)
    final = parse(answers[-1])
    if not final:
        return Graded(0.0, "no_answer")
    gold = _parse_gold(answer)
    if not gold:
        return Graded(0.0, "unparsable_reference")
    if rule == "agree":
        distinct = list(dict.fromkeys(" ".join(a.split()) for a in answers))
        if len(distinct) > MAX_ANSWERS:
            return Graded(0.0, "too_many_answers")
        for other in distinct[:-1]:
            if other != " ".join(answers[-1].split()) and not verify(final, parse(other)):
                return Graded(0.0, "conflicting_answers")
    gold_kind, kind = answer_kind(gold), answer_kind(final)
    if gold_kind == "value" and marked and _JOINERS_RE.search(_MATRIX_ENV_RE.sub("", answers[-1])):
        kind = "several values"
    if kind != gold_kind:
        return Graded(0.0, "not_a_single_value" if gold_kind == "value" else f"expected a {gold_kind}")
    return Graded(1.0 if verify(gold, final) else 0.0, "")


def is_equivalent(completion: str, answer: str, rule: str = "last") -> bool:
    """True when the completion's final answer equals `answer` under the answer rule `rule`."""
    return grade_math(completion, answer, rule).reward == 1.0


@register_reward("math")
def math_reward(prompt: str, completion: str, metadata: Mapping[str, Any]) -> Graded:
    """1.0 when the completion's answer equals the final answer of metadata["answer"] (a bare answer, or a
    GSM8K / MATH solution: see `reference_answer`) mathematically (fractions, LaTeX, ...), under the
    module's answer rule (metadata["answer_rule"], "last" by default; a single value).

    Raises:
      ValueError: the reference has a `####` or `\\boxed` marker with nothing usable after it, or
        metadata["answer_rule"] is unknown.
    """
    reference = str(metadata["answer"])
    answer = reference_answer(reference)
    if answer is None:
        raise ValueError(f"the reference has no final answer: {reference[-200:]!r}")
    return grade_math(completion, answer, str(metadata.get("answer_rule", "last")))


@register_reward("format")
def format_reward(prompt: str, completion: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the completion marks a final answer (`\\boxed{}`, `#### x`, `<answer>..</answer>`, or
    metadata["format_regex"])."""
    pattern = metadata.get("format_regex")
    regex = re.compile(pattern, re.DOTALL) if pattern else _FORMAT_RE
    return 1.0 if regex.search(completion) else 0.0
