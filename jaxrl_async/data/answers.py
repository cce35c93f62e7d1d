"""Extracting final answers from reference solutions and completions (GSM8K `####`, MATH `\\boxed{}`)."""

from __future__ import annotations

import re

_GSM8K_RE = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


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
