"""The calculator task (jaxrl_async.data.calc_tool): deterministic rows, a held-out split disjoint from
training, an exact reward, and a warm start that trains the model's turns and never the calculator's
results (a warm start that learned the results would teach the products: the task is then no longer
one that needs the tool)."""

import dataclasses

import jax
import numpy as np
import pytest

from configs import calc_tool as calc_tool_config
from jaxrl_async.data import DataConfig, held_out_prompts, reference_completion
from jaxrl_async.data.calc_tool import (
    TWO_CALL_SHARE,
    calc_tool_example,
    calc_tool_problem,
    parse_calc_tool,
    reference_segments,
)
from jaxrl_async.data.synthetic import synthetic_distinct
from jaxrl_async.envs import EnvConfig, calculator, tool_env_factory
from jaxrl_async.rewards.registry import get_reward
from jaxrl_async.run_config import ConfigError, validate
from jaxrl_async.tokenizer import CharTokenizer
from jaxrl_async.trainer.warmstart import episode_example, make_sft_batch

CFG = DataConfig(task="calc_tool", digits=3)


def test_rows_are_deterministic_and_depend_on_the_seed():
    rows = [calc_tool_example(CFG, "train", i) for i in range(200)]
    assert rows == [calc_tool_example(CFG, "train", i) for i in range(200)]
    other = [calc_tool_example(dataclasses.replace(CFG, seed=1), "train", i) for i in range(200)]
    assert sum(a["prompt"] == b["prompt"] for a, b in zip(rows, other, strict=True)) < 5
    two = sum(r["metadata"]["expression"].count("+") for r in rows) / len(rows)
    assert abs(two - TWO_CALL_SHARE) < 0.1  # some rows need two calls
    for r in rows:
        a, b, c = parse_calc_tool(r["prompt"])
        assert 100 <= a <= 999 and 10 <= b <= 99
        assert r["answer"] == str(a * b + (c or 0))


def test_held_out_split_is_disjoint_from_training():
    held = {r["prompt"] for r in synthetic_distinct(CFG, 500, "test")}
    assert len(held) == 500
    train = {calc_tool_example(CFG, "train", i)["prompt"] for i in range(5000)}
    assert not held & train
    prompts = held_out_prompts(CFG, CharTokenizer(), 50)
    assert [p.text for p in prompts] == [r["prompt"] for r in synthetic_distinct(CFG, 50, "test")]
    assert all(p.metadata["task"] == "calc_tool" for p in prompts)


def test_reward_is_the_exact_final_answer():
    reward = get_reward("calc_tool")
    meta = {"expression": "347*29+512", "answer": "10575"}
    episode = "<tool name=calculator>347*29</tool><result>10063</result>"
    assert reward("", "10575", meta) == 1.0
    second = "<tool name=calculator>10063+512</tool><result>10575</result>"
    assert reward("", f"{episode}{second}10575", meta) == 1.0
    assert reward("", " 10575 ", meta) == 1.0
    for wrong in ("10574", "105750", "1057", "", "10575 10575", "<result>10575</result>",
                  f"{second}<tool name=calculator>1"):  # fmt: skip
        assert reward("", wrong, meta) == 0.0, wrong
    # The value comes from the expression, not from metadata["answer"].
    assert reward("", "10063", {"expression": "347*29", "answer": "1"}) == 1.0


def test_reference_episode_is_what_the_tool_env_answers():
    """The warm start's observations are byte for byte what ToolEnv writes back, and its answer earns 1."""
    tok = CharTokenizer()
    prompt, answer, _ = calc_tool_problem(347, 29, 512)
    segments = reference_segments(prompt)
    assert [m for _, m in segments] == [True, False, True, False, True]
    cfg = EnvConfig(tools=("calculator",), max_turns=4)
    meta = {"expression": "347*29+512"}
    make_env, executor = tool_env_factory(cfg, tok, lambda row, text: get_reward("calc_tool")("", text, row))
    env = make_env(meta)
    for (text, is_model), nxt in zip(segments, segments[1:] + [None], strict=True):
        if not is_model:
            continue
        result = env.step(text)
        if nxt is None:
            assert result.done and result.reward == 1.0
        else:
            assert not result.done and tok.decode(result.observation) == nxt[0]
    executor.close()
    assert calculator("347*29") == "10063"
    with pytest.raises(ValueError, match="reference episode"):
        reference_completion(prompt)


def test_warm_start_masks_the_calculator_results_out_of_the_loss():
    tok = CharTokenizer()
    prompt, _, _ = calc_tool_problem(347, 29, 512)
    segments = reference_segments(prompt)
    p_ids, completion, model = episode_example(tok.encode, tok.eos_id, tok.encode(prompt), segments)
    inputs, targets, mask = make_sft_batch([(p_ids, completion, model)], 160)
    trained = targets[0][mask[0] > 0]
    untrained = targets[0][(mask[0] == 0) & (np.arange(160) >= len(p_ids) - 1)][: len(completion)]
    text_of = lambda ids: "".join(tok.decode([i]) if i != tok.eos_id else "|" for i in ids)
    # Exactly the three turns, each ending with its stop token, are targets...
    turns = "<tool name=calculator>347*29</tool>|<tool name=calculator>10063+512</tool>|10575|"
    assert text_of(trained) == turns
    # ...and no result is: the products appear only as inputs.
    assert "<result>" not in text_of(trained)
    assert text_of(untrained).startswith("<result>10063</result><result>10575</result>")
    assert mask[0].sum() == sum(model)
    # A pair (single-turn example) still trains its whole completion.
    _, _, pair_mask = make_sft_batch([(p_ids, completion)], 160)
    assert pair_mask[0].sum() == len(completion)
    with pytest.raises(ValueError, match="model mask"):
        make_sft_batch([(p_ids, completion, model[:-1])], 160)


def test_config_validates_fits_the_longest_episode_and_refuses_the_task_without_the_tool(tmp_path):
    c = calc_tool_config.get_config()
    c.workdir = str(tmp_path)
    run = validate(c, len(jax.devices()))
    assert run.reward.reward == "calc_tool" and run.env.enabled and run.env.tools == ("calculator",)
    tok = CharTokenizer()
    prompt = calc_tool_problem(999, 99, 999)[0]  # the longest problem of 3 digits
    segments = reference_segments(prompt)
    p_ids, completion, _ = episode_example(tok.encode, tok.eos_id, tok.encode(prompt), segments)
    assert len(p_ids) <= run.sampler.max_prompt_len
    assert len(completion) <= run.env.max_episode_tokens
    assert len(p_ids) + len(completion) <= run.warm_start.seq_len + 1
    assert max(len(tok.encode(t)) + 1 for t, m in segments if m) <= run.sampler.max_new_tokens
    c.env.enabled = False
    c.env.tools = ()
    with pytest.raises(ConfigError, match=r"config\.env\.enabled"):
        validate(c, len(jax.devices()))
    c.env.enabled = True
    with pytest.raises(ConfigError, match=r"config\.env\.tools"):
        validate(c, len(jax.devices()))
