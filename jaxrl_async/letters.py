"""The letter-range task's one rule: its alphabet and the span of letters from one bound to another. The
generator (`jaxrl_async.data.letter_range`) builds each answer with it and the verifier
(`jaxrl_async.rewards.synthetic`, reward "letter_range") rebuilds it from the prompt's bounds, so the reward
cannot drift from the data. Plain Python, below both (data and rewards import nothing of each other)."""

from __future__ import annotations

ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def letter_range(first: str, last: str) -> str:
    """Every letter of ALPHABET from `first` to `last`, both included, in either direction.

    Raises:
      ValueError: a bound is not one letter of ALPHABET.
    """
    if len(first) != 1 or len(last) != 1 or first not in ALPHABET or last not in ALPHABET:
        raise ValueError(f"letter_range: bounds must be letters of {ALPHABET!r}, got {first!r}, {last!r}")
    i, j = ALPHABET.index(first), ALPHABET.index(last)
    return ALPHABET[i : j + 1] if i <= j else ALPHABET[j : i + 1][::-1]
