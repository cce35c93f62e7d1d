"""The letter-range task: answers whose length is long-tailed because the task's own input sizes are.

Prompt "range d-k:", completion every letter from the first to the last in the order of `ALPHABET`
("defghijk"); a range may also run down ("range k-d:" -> "kjihgfed") and across the case boundary ("range
x-C:" -> "xyzABC"). Its span, the answer's length in letters (1 to 52), is exp(u^p ln 53) for u uniform on
[0, 1) and p = DataConfig.letter_span_power: p = 1 is log-uniform, so short answers are common and long ones
rare but present (the reference answers' median is 8 tokens, stop token included, and their p99 51); p = 1.5
(configs/letter_range.py) halves the median (4) and keeps the p99 (50). That is a tail the sampler meets
because of the problems themselves, not because a length cap was drawn. Each answer letter follows from the
previous one (the next or the previous letter of the alphabet) and the stop from a comparison with the
prompt's last letter, so a tiny character model learns it from a short supervised warm start. Its misses are
mostly on short ranges (it runs past the stop; `jaxrl-evaluate --by_length` shows where), which is also
why its own completions are less skewed than the references (at p = 1 their p99/median was 2.7-3.0; at 1.5,
7.3-8.7).

The problem space is small (52 x 52 ranges; at heldout_fraction 0.1 a stable hash puts 275 in the held-out
split), so the held-out set is every held-out range once, each with its probability under the span
distribution as its weight (`Prompt.weight`): the weighted accuracy over all of them is the exact
accuracy over the task's own mix, with no sampling noise. Unweighted, long ranges, which are most of the
distinct ones, would dominate; drawn with repetition, 200 draws leave a standard error of about 0.03
near 0.5, as large as the differences between runs an evaluation is meant to show. Exact is not fine-
grained, though: the split holds 6 of the 52 one-letter ranges, 19% of its weight at power 1 (33% at 1.5),
so one of them answered differently moves the accuracy by 3 (5.5) points, and a tiny model memorizes the
trained ones rather than inferring the others. DataConfig.letter_heldout_min_span = 2 keeps them all in
training: the held-out split is then the 269 other held-out ranges, and its heaviest prompt moves the
accuracy by 1.2 (1.5) points. Fewer than
all of them are a random subset (fixed order per seed) whose weighted accuracy estimates the same number.
Metadata carries "first" and "last"; the verifier ("letter_range", jaxrl_async.rewards.synthetic) rebuilds
the answer from them with the same rule (`jaxrl_async.letters.letter_range`).
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

from jaxrl_async.data.prompt import DataConfig, is_heldout
from jaxrl_async.letters import ALPHABET, letter_range  # the span rule the verifier shares

_RANGE_RE = re.compile(r"range ([a-zA-Z])-([a-zA-Z]):")


def letter_range_problem(first: str, last: str) -> tuple[str, str]:
    """(prompt, answer), e.g. ("d", "k") -> ("range d-k:", "defghijk")."""
    return f"range {first}-{last}:", letter_range(first, last)


def parse_letter_range(prompt: str) -> tuple[str, str] | None:
    """(first, last) of the last range in `prompt`, or None when it holds none."""
    m = _RANGE_RE.findall(prompt)
    return m[-1] if m else None


def _draw(rng: random.Random, power: float) -> tuple[str, str]:
    n = len(ALPHABET)
    # power 1: log-uniform on 1..n; above 1, more short spans and fewer long ones (all stay possible).
    span = min(n, int(math.exp(rng.random() ** power * math.log(n + 1))))
    start = rng.randrange(n - span + 1)
    lo, hi = ALPHABET[start], ALPHABET[start + span - 1]
    return (hi, lo) if rng.random() < 0.5 else (lo, hi)


def _held_out(cfg: DataConfig, first: str, last: str) -> bool:
    """Whether the range (first, last) is in the held-out split: by stable hash, unless its span is below
    cfg.letter_heldout_min_span."""
    span = abs(ALPHABET.index(first) - ALPHABET.index(last)) + 1
    return span >= cfg.letter_heldout_min_span and is_heldout(f"{first}-{last}", cfg.heldout_fraction)


def letter_range_example(cfg: DataConfig, split: str, index: int) -> dict[str, Any]:
    """The `index`-th record of `split` ("train" or "test"): a deterministic function of (seed, split,
    index); a range is in exactly one split."""
    rng = random.Random(f"letter_range:{cfg.seed}:{split}:{index}")
    while True:
        first, last = _draw(rng, cfg.letter_span_power)
        if _held_out(cfg, first, last) == (split == "test"):
            prompt, answer = letter_range_problem(first, last)
            uid, meta = f"letter_range:{split}:{index}", {"first": first, "last": last}
            return {"uid": uid, "prompt": prompt, "answer": answer, "metadata": meta}


def range_probabilities(power: float) -> dict[tuple[str, str], float]:
    """{(first, last): the probability that `_draw` gives that range}, over all 52 x 52 ranges (sums to 1).

    P(span = s) = (ln(s + 1) / L)^(1/p) - (ln s / L)^(1/p), L = ln 53, from span = floor(exp(u^p L)); then
    a start uniform over the 53 - s places and either direction (one range when s = 1)."""
    n, log_top = len(ALPHABET), math.log(len(ALPHABET) + 1)
    probs: dict[tuple[str, str], float] = {}
    for span in range(1, n + 1):
        p_span = (math.log(span + 1) / log_top) ** (1 / power) - (math.log(span) / log_top) ** (1 / power)
        for start in range(n - span + 1):
            lo, hi = ALPHABET[start], ALPHABET[start + span - 1]
            for pair in ((lo, hi), (hi, lo)):
                probs[pair] = probs.get(pair, 0.0) + p_span / (n - span + 1) / 2
    return probs


def letter_range_distinct(cfg: DataConfig, n: int, split: str = "test") -> list[dict[str, Any]]:
    """Up to `n` distinct ranges of `split` in a fixed random order (by cfg.seed), each record's "weight" its
    probability under the task's span distribution, renormalized over the split (see the module
    docstring): all of the held-out ones (n >= 275 at heldout_fraction 0.1; 269 with letter_heldout_min_span
    2) give the exact held-out accuracy; all of the training ones (2,429; 2,435) the exact accuracy on
    what RL trains on."""
    probs = range_probabilities(cfg.letter_span_power)
    test = split == "test"
    in_split = {p: w for p, w in probs.items() if _held_out(cfg, *p) == test}
    total = sum(in_split.values())
    order = sorted(in_split)
    random.Random(f"letter_range:{cfg.seed}:{'heldout' if test else split}").shuffle(order)
    out = []
    for first, last in order[:n]:
        prompt, answer = letter_range_problem(first, last)
        meta, weight = {"first": first, "last": last}, in_split[(first, last)] / total
        uid = f"letter_range:{split}:{first}-{last}"
        out.append({"uid": uid, "prompt": prompt, "answer": answer, "metadata": meta, "weight": weight})
    return out
