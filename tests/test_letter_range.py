"""The letter-range task: deterministic generation, a long tail of its own, its verifier and its config."""

import collections
import random

import jax
import numpy as np
import pytest

from configs import letter_range as letter_range_config
from jaxrl_async.data import DataConfig, held_out_prompts, make_prompt_iterator, reference_completion
from jaxrl_async.data.letter_range import (
    ALPHABET,
    _draw,
    letter_range,
    letter_range_example,
    letter_range_problem,
    range_probabilities,
)
from jaxrl_async.data.prompt import is_heldout
from jaxrl_async.rewards import synthetic as reward_synthetic
from jaxrl_async.rewards.registry import get_reward
from jaxrl_async.rewards.service import RewardConfig, grade_one
from jaxrl_async.run_config import validate
from jaxrl_async.tokenizer import CharTokenizer


def test_generation_is_a_function_of_seed_split_and_index():
    cfg = DataConfig(task="letter_range", seed=4)
    a = [letter_range_example(cfg, "train", i) for i in range(50)]
    assert a == [letter_range_example(cfg, "train", i) for i in range(50)]
    other = [letter_range_example(DataConfig(task="letter_range", seed=5), "train", i) for i in range(50)]
    assert [r["prompt"] for r in a] != [r["prompt"] for r in other]
    tok = CharTokenizer()
    first = [p.text for p, _ in zip(make_prompt_iterator(cfg, tok), range(20), strict=False)]
    again = [p.text for p, _ in zip(make_prompt_iterator(cfg, tok), range(20), strict=False)]
    assert first == again
    for r in a:
        assert r["prompt"] == f"range {r['metadata']['first']}-{r['metadata']['last']}:"
        assert reference_completion(r["prompt"]) == r["answer"] == letter_range(**r["metadata"])
    held = held_out_prompts(cfg, tok, 1000)
    train = {r["prompt"] for r in (letter_range_example(cfg, "train", i) for i in range(3000))}
    assert not {p.text for p in held} & train  # a range is in one split only


def test_held_out_set_is_every_held_out_range_once_weighted_by_its_probability():
    tok = CharTokenizer()
    cfg = DataConfig(task="letter_range", seed=3)
    held = held_out_prompts(cfg, tok, 1000)
    pairs = {(p.metadata["first"], p.metadata["last"]) for p in held}
    every = {(a, b) for a in ALPHABET for b in ALPHABET if is_heldout(f"{a}-{b}", cfg.heldout_fraction)}
    assert pairs == every and len(held) == len(every) == 275  # distinct, and all of them
    assert sum(p.weight for p in held) == pytest.approx(1.0)
    # The weights are what the held-out draws of the task's own stream would give, span by span.
    probs = range_probabilities(1.0)
    assert sum(probs.values()) == pytest.approx(1.0)
    rng = random.Random(0)
    counts = collections.Counter(_draw(rng, 1.0) for _ in range(40_000))
    def share(d, lo, hi):
        return sum(v for (a, b), v in d.items() if lo <= len(letter_range(a, b)) <= hi)

    for lo, hi in ((1, 2), (3, 5), (6, 12), (13, 25), (26, 52)):
        assert share(counts, lo, hi) / 40_000 == pytest.approx(share(probs, lo, hi), abs=0.01), (lo, hi)
    # Fewer: a random subset (fixed per seed), still weighted; the order differs between seeds.
    some = held_out_prompts(cfg, tok, 50)
    assert [p.uid for p in some] == [p.uid for p in held[:50]]
    other_seed = held_out_prompts(DataConfig(task="letter_range"), tok, 50)
    assert [p.uid for p in some] != [p.uid for p in other_seed]
    # Short ranges carry most of the weight: the exact accuracy weighs them as the stream does.
    short = sum(p.weight for p in held if len(p.answer) <= 8)
    assert short > 0.5 > sum(len(p.answer) <= 8 for p in held) / len(held)


def test_the_training_split_is_scored_the_same_way():
    tok = CharTokenizer()
    cfg = DataConfig(task="letter_range", seed=3)
    held, train = held_out_prompts(cfg, tok, 5000), held_out_prompts(cfg, tok, 5000, "train")
    pairs = {(p.metadata["first"], p.metadata["last"]) for p in train}
    assert len(pairs) == len(train) == 52 * 52 - len(held) == 2429  # distinct, and all of them
    assert not pairs & {(p.metadata["first"], p.metadata["last"]) for p in held}
    assert sum(p.weight for p in train) == pytest.approx(1.0)
    probs = range_probabilities(1.0)  # renormalized over the split, in the same proportions
    (fa, la), (fb, lb) = ((p.metadata["first"], p.metadata["last"]) for p in train[:2])
    assert train[0].weight / train[1].weight == pytest.approx(probs[(fa, la)] / probs[(fb, lb)])
    # What training draws: every range of the stream is one of these.
    stream = {r["prompt"] for r in (letter_range_example(cfg, "train", i) for i in range(2000))}
    assert stream <= {p.text for p in train}
    again = held_out_prompts(cfg, tok, 5000, "test")
    assert [(p.uid, p.weight) for p in again] == [(p.uid, p.weight) for p in held]
    with pytest.raises(ValueError, match="split"):
        held_out_prompts(cfg, tok, 5, "dev")


def test_short_ranges_can_be_kept_out_of_the_held_out_split():
    tok = CharTokenizer()
    cfg = DataConfig(task="letter_range", seed=3, letter_heldout_min_span=2)
    held, train = held_out_prompts(cfg, tok, 5000), held_out_prompts(cfg, tok, 5000, "train")
    held_pairs = {(p.metadata["first"], p.metadata["last"]) for p in held}
    train_pairs = {(p.metadata["first"], p.metadata["last"]) for p in train}
    assert min(len(p.answer) for p in held) == 2  # no one-letter range is held out ...
    assert {(a, a) for a in ALPHABET} <= train_pairs  # ... all 52 of them train
    assert len(held_pairs | train_pairs) == len(held) + len(train) == 52 * 52 and not held_pairs & train_pairs
    assert sum(p.weight for p in held) == pytest.approx(1.0) == sum(p.weight for p in train)
    # Longer ranges are split as before, so the held-out set is the default's without its one-letter ranges.
    default = held_out_prompts(DataConfig(task="letter_range", seed=3), tok, 5000)
    assert held_pairs == {(p.metadata["first"], p.metadata["last"]) for p in default if len(p.answer) > 1}
    # The stream agrees with the distinct sets: its held-out draws are never one letter long.
    assert all(len(letter_range_example(cfg, "test", i)["answer"]) > 1 for i in range(500))
    stream = {r["prompt"] for r in (letter_range_example(cfg, "train", i) for i in range(2000))}
    assert stream <= {p.text for p in train}
    # The heaviest held-out prompt moves the exact accuracy by less than a third of what it did.
    assert max(p.weight for p in held) < max(p.weight for p in default) / 2.5
    with pytest.raises(ValueError, match="letter_heldout_min_span"):
        DataConfig(task="letter_range", letter_heldout_min_span=0)
    with pytest.raises(ValueError, match="apply to task 'letter_range' only"):
        DataConfig(task="arithmetic", letter_heldout_min_span=2)  # another task would ignore it


def test_answers_run_both_ways_and_across_the_case_boundary():
    assert letter_range("d", "k") == "defghijk" and letter_range("k", "d") == "kjihgfed"
    assert letter_range("x", "C") == "xyzABC" and letter_range("c", "a") == "cba"
    assert letter_range("q", "q") == "q" and letter_range("a", "Z") == ALPHABET
    assert letter_range("Z", "a") == ALPHABET[::-1]


def test_the_verifier_grades_with_the_generators_span_rule():
    """One rule (jaxrl_async.letters), so the reward cannot drift from the data: every range's generated
    answer gets reward 1, and that answer one letter short or long gets 0."""
    assert reward_synthetic.letter_range is letter_range
    for a in ALPHABET:
        for b in ALPHABET:
            prompt, answer = letter_range_problem(a, b)
            meta = {"first": a, "last": b}
            assert reward_synthetic.letter_range_reward(prompt, f" {answer}\n", meta) == 1.0
            assert reward_synthetic.letter_range_reward(prompt, answer[:-1], meta) == 0.0
            assert reward_synthetic.letter_range_reward(prompt, answer + answer[-1], meta) == 0.0


def test_reference_answers_are_long_tailed_in_tokens():
    tok = CharTokenizer()
    cfg = DataConfig(task="letter_range", seed=0)
    it = make_prompt_iterator(cfg, tok)
    # What the sampler must generate: the answer's tokens and the stop token.
    lengths = np.asarray([len(tok.encode(reference_completion(next(it).text))) + 1 for _ in range(3000)])
    p50, p99 = np.percentile(lengths, [50, 99])
    assert p99 / p50 >= 4, (p50, p99)
    # Held-out follows the same mix: weighted percentiles of its answers' lengths.
    held = sorted((len(p.answer) + 1, p.weight) for p in held_out_prompts(cfg, tok, 1000))
    cum = np.cumsum([w for _, w in held])
    p50, p99 = (held[int(np.searchsorted(cum, q))][0] for q in (0.5, 0.99))
    assert p99 / p50 >= 4, (p50, p99)
    assert lengths.max() <= len(ALPHABET) + 1


def test_span_power_makes_short_ranges_commoner_and_is_validated():
    def spans(power):
        cfg = DataConfig(task="letter_range", seed=0, letter_span_power=power)
        return np.asarray([len(letter_range_example(cfg, "train", i)["answer"]) for i in range(3000)])

    flat, skewed = spans(1.0), spans(1.5)
    assert np.median(skewed) < np.median(flat) and np.mean(skewed <= 4) > np.mean(flat <= 4) + 0.1
    for s in (flat, skewed):  # the same support: long ranges still come
        assert s.min() == 1 and s.max() >= 45
    with pytest.raises(ValueError, match="letter_span_power"):
        DataConfig(task="letter_range", letter_span_power=0.0)


def test_verifier_right_wrong_and_malformed():
    grade = get_reward("letter_range")
    meta = {"first": "d", "last": "k", "answer": "defghijk"}
    assert grade("range d-k:", "defghijk", meta) == 1.0
    assert grade("range d-k:", " defghijk\n", meta) == 1.0  # surrounding whitespace is no mistake
    assert grade("range d-k:", "defgXXXX", meta) == 0.0  # exact answers only
    assert grade("range d-k:", "defghij", meta) == 0.0  # stopped one letter early
    assert grade("range d-k:", "defghijkl", meta) < 1.0  # an extra letter costs
    assert grade("range d-k:", "kjihgfed", meta) == 0.0
    assert grade("range d-k:", "", meta) == 0.0
    # The answer is rebuilt from the bounds, never read from metadata["answer"].
    assert grade("range d-k:", "defghijk", {**meta, "answer": "zzz"}) == 1.0
    # What a reward worker runs on each request: a failing verifier is reward 0 with the reason, no crash.
    cfg = RewardConfig(reward="letter_range")
    assert grade_one(cfg, "range d-k:", "defghijk", meta)[:2] == (1.0, "ok")
    reward, reason, _ = grade_one(cfg, "range d-k:", "defghijk", {"answer": "defghijk"})
    assert (reward, reason) == (0.0, "error:KeyError")
    reward, reason, _ = grade_one(cfg, "range d-k:", "defghijk", {"first": "7", "last": "kk"})
    assert (reward, reason) == (0.0, "error:ValueError")


def test_config_validates_and_fits_the_longest_answer(tmp_path):
    c = letter_range_config.get_config()
    c.workdir = str(tmp_path)
    run = validate(c, len(jax.devices()))
    assert run.data.task == "letter_range" and run.reward.reward == "letter_range"
    longest = len(CharTokenizer().encode(f"range a-Z:{ALPHABET}")) + 1
    assert run.warm_start.seq_len + 1 >= longest
    assert run.sampler.max_new_tokens >= len(ALPHABET) + 1
    # The config's own mix keeps the long tail, and its held-out set is every held-out range once.
    tok = CharTokenizer()
    it = make_prompt_iterator(run.data, tok)
    lengths = [len(reference_completion(next(it).text)) + 1 for _ in range(2000)]
    p50, p99 = np.percentile(lengths, [50, 99])
    assert p99 / p50 >= 4, (p50, p99)
    held = held_out_prompts(run.data, tok, 10_000)
    assert len(held) == run.eval.prompts
    assert min(len(p.answer) for p in held) >= run.data.letter_heldout_min_span
