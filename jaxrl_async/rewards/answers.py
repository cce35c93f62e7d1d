"""Final answers in text: GSM8K's `#### x`, MATH's `\\boxed{x}`, for reference solutions and completions."""

from __future__ import annotations

import re

_GSM8K_RE = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)
# Which of a completion's marked answers the math reward grades (rewards/math.py, rule 2): only the last,
# or all of them, which must agree.
ANSWER_RULES = ("last", "agree")


def extract_boxed(text: str) -> str | None:
    """Contents of the last `\\boxed{...}` (or `\\fbox{...}`) with balanced braces, else None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def extract_gsm8k(text: str) -> str | None:
    """The number after GSM8K's final `#### `, thousands separators removed, else None."""
    m = _GSM8K_RE.search(text)
    if not m:
        return None
    return m.group(1).replace(",", "").strip()


def reference_answer(reference: str) -> str | None:
    """The final answer of a reference (a prompt's metadata["answer"]): the text after GSM8K's last `####`,
    else the last `\\boxed{}` (MATH solutions), else the whole stripped text; None when a marker is there
    but empty or unbalanced."""
    if "####" in reference:
        return extract_gsm8k(reference) or None
    if "\\boxed" in reference or "\\fbox" in reference:
        return extract_boxed(reference) or None
    return reference.strip() or None
