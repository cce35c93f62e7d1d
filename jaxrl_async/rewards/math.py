"""Math answer equivalence with math-verify, and an optional format reward."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from jaxrl_async.data.answers import extract_boxed
from jaxrl_async.rewards.registry import Graded, register_reward

_ANSWER_TAG_RE = re.compile(r"<answer>(.+?)</answer>", re.DOTALL)
_FORMAT_RE = re.compile(r"(\\boxed\{.+\}|####\s*\S|<answer>.+?</answer>)", re.DOTALL)


def _parse_gold(answer: str):
    from math_verify import parse

    parsed = parse(answer) if "$" in answer or "\\boxed" in answer else []
    # A bare reference answer ("3/4", "\\frac{1}{2}") parses most reliably as inline LaTeX.
    return parsed or parse(f"${answer}$") or parse(answer)


def _candidate_text(completion: str) -> str:
    """Narrows the completion to its final answer when it marks one; otherwise math-verify searches it."""
    boxed = extract_boxed(completion)
    if boxed is not None:
        return f"\\boxed{{{boxed}}}"
    tagged = _ANSWER_TAG_RE.findall(completion)
    if tagged:
        return f"${tagged[-1].strip()}$"
    if "####" in completion:
        return completion.rsplit("####", 1)[1].strip().replace(",", "")
    return completion


def is_equivalent(completion: str, answer: str) -> bool:
    """True when the completion's final answer equals `answer` mathematically (math-verify)."""
    from math_verify import parse, verify

    gold = _parse_gold(answer)
    pred = parse(_candidate_text(completion))
    if not gold or not pred:
        return False
    return bool(verify(gold, pred))


@register_reward("math")
def math_reward(prompt: str, completion: str, metadata: Mapping[str, Any]) -> Graded:
    """1.0 when the completion's answer equals metadata["answer"] mathematically (fractions, LaTeX, ...)."""
    from math_verify import parse

    answer = str(metadata["answer"])
    if not parse(_candidate_text(completion)):
        return Graded(0.0, "no_answer")
    return Graded(1.0 if is_equivalent(completion, answer) else 0.0, "")


@register_reward("format")
def format_reward(prompt: str, completion: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the completion marks a final answer (`\\boxed{}`, `#### x`, `<answer>..</answer>`, or
    metadata["format_regex"])."""
    pattern = metadata.get("format_regex")
    regex = re.compile(pattern, re.DOTALL) if pattern else _FORMAT_RE
    return 1.0 if regex.search(completion) else 0.0
