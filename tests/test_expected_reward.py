"""The held-out expected reward (runtime/expected_reward.py) against a brute-force sum over every
completion a sampler could write, on a tiny model with a 6-token vocabulary."""

import itertools

import jax
import numpy as np
import pytest

from jaxrl_async.data.prompt import Prompt
from jaxrl_async.model import init_params, presets
from jaxrl_async.model.transformer import forward_logits
from jaxrl_async.rewards.synthetic import arithmetic_reward
from jaxrl_async.runtime.expected_reward import check_applicable, expected_reward
from jaxrl_async.tokenizer import CharTokenizer

TOK = CharTokenizer("ab ")  # pad 0, bos 1, eos 2, "a" 3, "b" 4, " " 5
CFG = presets.tiny(vocab_size=TOK.vocab_size, n_layers=1, max_seq_len=16)
PARAMS = init_params(CFG, jax.random.key(0))
STOP = (TOK.eos_id,)


def _prompt(uid, text, answer, weight=1.0):
    tokens = np.array([TOK.bos_id, *TOK.encode(text)], np.int32)
    return Prompt(uid, text, tokens, answer, {"answer": answer, "task": "arithmetic"}, weight=weight)


def _every_completion(prompt, max_new, temperature):
    """(tokens, probability) of every completion: sampling stops at a stop token (kept) or the limit."""
    out = []
    for n in range(1, max_new + 1):
        for seq in itertools.product(range(TOK.vocab_size), repeat=n):
            if any(t in STOP for t in seq[:-1]) or (n < max_new and seq[-1] not in STOP):
                continue  # stopped earlier, or not finished yet
            logp = 0.0
            for k, t in enumerate(seq):  # one full forward per prefix: no shared code with the metric
                ctx = np.array([[*prompt.tokens, *seq[:k]]], np.int32)
                logits = np.asarray(forward_logits(CFG, PARAMS, ctx))[0, -1] / temperature
                logp += logits[t] - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
            out.append((seq, np.exp(logp)))
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_it_is_the_exact_probability_of_the_accepted_completions(temperature):
    max_new = 3
    prompts = [_prompt("p0", "ab", "ab"), _prompt("p1", "b", "ba", weight=3.0), _prompt("p2", "a", "bab")]
    got = expected_reward(CFG, PARAMS, prompts=prompts, tokenizer=TOK, stop_tokens=STOP,
                          max_new_tokens=max_new, temperature=temperature)
    per_prompt, graded = [], []
    for p in prompts:
        every = _every_completion(p, max_new, temperature)
        assert sum(q for _, q in every) == pytest.approx(1.0, abs=1e-4)  # the enumeration is complete
        answer = TOK.encode(p.answer)
        accepted = (tuple(answer),) if len(answer) == max_new else (tuple([*answer, TOK.eos_id]),)
        per_prompt.append(sum(q for seq, q in every if seq in accepted))
        # The reward itself (it strips whitespace, and decoding drops pad/bos) accepts a few more.
        graded.append(sum(q * arithmetic_reward("", TOK.decode(seq), p.metadata) for seq, q in every))
    want = np.average(per_prompt, weights=[1.0, 3.0, 1.0])
    assert got.mean == pytest.approx(want, rel=1e-4) and got.prompts == 3
    assert got.mean <= np.average(graded, weights=[1.0, 3.0, 1.0]) + 1e-6  # a lower bound of the reward's
    assert 0 < got.stderr < 1 and per_prompt[2] > 0  # "bab" fills max_new: accepted without a stop token


def test_it_refuses_what_it_cannot_compute_exactly_naming_the_field():
    with pytest.raises(ValueError, match="config.reward.reward='countdown'"):
        check_applicable("countdown", 1.0, 0, 1.0)
    with pytest.raises(ValueError, match="config.sampler.temperature=0"):
        check_applicable("arithmetic", 0.0, 0, 1.0)
    with pytest.raises(ValueError, match="config.sampler.top_k=5"):
        check_applicable("letter_range", 1.0, 5, 1.0)
    check_applicable("letter_range", 1.0, 0, 1.0)


def test_a_run_reports_the_expected_reward_of_the_versions_it_evaluates(tmp_path):
    """The run's own evaluations carry it (TensorBoard, summary.json), equal to the figure of the saved
    version scored again from its checkpoint; the format bonus gives the untrained model a signal."""
    import os

    from jaxrl_async.data import held_out_prompts
    from jaxrl_async.run_config import validate
    from jaxrl_async.runtime.build import build_tokenizer, sampler_config
    from jaxrl_async.runtime.checkpoint import load_policy
    from jaxrl_async.runtime.metrics import read_scalars
    from jaxrl_async.runtime.orchestrator import run_from_config
    from jaxrl_async.sharding import SAMPLER_RULES, make_mesh
    from tests.test_orchestrator import _small

    c = _small(tmp_path, mode="sync", total_steps=2, eval_every=2, checkpoint_every=2,
               **{"reward.reward": "arithmetic", "reward.format_weight": 0.5})  # fmt: skip
    summary = run_from_config(c)
    got = {e["step"]: e["expected_reward"] for e in summary["evals"]}
    assert sorted(got) == [0, 2] and all(0 < v < 1 for v in got.values()), got
    logged = dict(read_scalars(os.path.join(tmp_path, "tb"))["eval/expected_reward"])
    assert logged == pytest.approx(got)
    run = validate(c, len(jax.devices()))
    tok = build_tokenizer(run)
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    model_cfg, params, _, version = load_policy(str(tmp_path), mesh, SAMPLER_RULES)
    smp = sampler_config(run, tok)
    again = expected_reward(model_cfg.compute_copy(), params, prompts=held_out_prompts(run.data, tok, 16),
                            tokenizer=tok, stop_tokens=smp.stop_tokens, max_new_tokens=smp.max_new_tokens,
                            temperature=smp.temperature)  # fmt: skip
    assert version == 2 and again.mean == pytest.approx(got[2], rel=1e-4)
