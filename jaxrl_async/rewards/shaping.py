"""Reward shaping on the completion's length (applied by the actor after grading; the verifier never
sees it).

DAPO's soft overlong punishment: completions within `buffer` tokens of the generation cap `max_len` lose
reward linearly, reaching -penalty at the cap. A truncated answer is then not graded as if it were a
finished wrong one only by chance, and the policy learns to finish before the cap instead of being cut.
"""

from __future__ import annotations


def overlong_penalty(length: int, max_len: int, buffer: int, penalty: float = 1.0) -> float:
    """The shaping term added to a completion's reward (<= 0).

    Args:
      length: completion tokens (the stop token included when emitted).
      max_len: the generation cap (sampler.max_new_tokens).
      buffer: width of the soft window before the cap; 0 = no shaping.
      penalty: the term's magnitude at and past the cap.

    Returns:
      0 while length <= max_len - buffer; -penalty * (length - (max_len - buffer)) / buffer inside the
      window; -penalty at and past the cap.
    """
    if buffer <= 0:
        return 0.0
    start = max_len - buffer
    if length <= start:
        return 0.0
    return -penalty * min(length - start, buffer) / buffer
