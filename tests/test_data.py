"""Prompt data: synthetic tasks, file sources, the grain pipeline and its checkpointed state."""

import json
import logging
import re

import numpy as np
import pytest

from jaxrl_async.data import (
    DataConfig,
    held_out_prompts,
    load_records,
    make_prompt_iterator,
    reference_completion,
    solve_countdown,
)
from jaxrl_async.rewards import get_reward
from jaxrl_async.rewards.synthetic import countdown_verify
from jaxrl_async.run_config import TASK_REWARD
from jaxrl_async.tokenizer import CHAR_VOCAB, CharTokenizer, HFTokenizer

TOK = CharTokenizer()


def _take(it, n):
    return [next(it) for _ in range(n)]


# ---- synthetic tasks ----------------------------------------------------------------------------------


def test_arithmetic_format_and_reference():
    cfg = DataConfig(task="arithmetic", digits=2, operators="+", num_train=50)
    for p in _take(make_prompt_iterator(cfg, TOK), 50):
        m = re.fullmatch(r"(\d{1,2})\+(\d{1,2})=", p.text)
        assert m, p.text
        assert p.answer == str(int(m[1]) + int(m[2])) == reference_completion(p.text)
        assert TOK.decode(p.tokens) == p.text and p.tokens.dtype == np.int32
        assert p.metadata == {"answer": p.answer, "task": "arithmetic"}  # the run names the reward
        assert get_reward(TASK_REWARD[p.metadata["task"]])(p.text, p.answer, p.metadata) == 1.0


def test_arithmetic_operators_and_digits_configurable():
    cfg = DataConfig(task="arithmetic", digits=3, operators="+-*", num_train=300)
    prompts = list(make_prompt_iterator(cfg, TOK))
    assert {re.search(r"[+\-*]", p.text)[0] for p in prompts} == {"+", "-", "*"}
    assert max(len(p.text) for p in prompts) <= 3 + 1 + 3 + 1
    assert any(p.answer.startswith("-") for p in prompts)
    for p in prompts:
        assert set(p.text + p.answer) <= set(CHAR_VOCAB)
        assert str(eval(p.text[:-1])) == p.answer == reference_completion(p.text)


def test_arithmetic_heldout_disjoint_and_deterministic():
    cfg = DataConfig(task="arithmetic", digits=2, operators="+-", num_train=5000, heldout_fraction=0.1)
    train = {p.text for p in make_prompt_iterator(cfg, TOK)}
    held = held_out_prompts(cfg, TOK, 500)
    held_texts = [p.text for p in held]
    assert len(set(held_texts)) == 500  # distinct
    assert not train & set(held_texts)
    assert held_texts == [p.text for p in held_out_prompts(cfg, TOK, 500)]
    test_iter = [p.text for p in make_prompt_iterator(cfg, TOK, split="test")]
    assert not train & set(test_iter) and len(test_iter) == cfg.num_eval


def test_countdown_tasks_solvable_and_verified():
    cfg = DataConfig(task="countdown", num_train=40, countdown_numbers=3)
    for p in make_prompt_iterator(cfg, TOK):
        assert set(p.text) <= set(CHAR_VOCAB)
        nums, target = p.metadata["numbers"], p.metadata["target"]
        assert countdown_verify(p.metadata["solution"], nums, target)
        ref = reference_completion(p.text)
        assert get_reward(TASK_REWARD[p.metadata["task"]])(p.text, ref, p.metadata) == 1.0
    train = {p.text for p in make_prompt_iterator(cfg, TOK)}
    assert not train & {p.text for p in held_out_prompts(cfg, TOK, 100)}


def test_countdown_solver():
    assert countdown_verify(solve_countdown([5, 8, 8], 24), [5, 8, 8], 24)
    assert solve_countdown([4, 6], 5) is None


# ---- files --------------------------------------------------------------------------------------------


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_skips_malformed_lines_with_line_numbers(tmp_path, caplog):
    lines = [
        json.dumps({"question": "1+1?", "answer": "2"}),
        "{not json",
        json.dumps({"question": "2+2?"}),  # missing answer
        json.dumps(["a list"]),
        json.dumps({"question": "4+4?", "answer": " "}),
        json.dumps({"question": "3+3?", "answer": "6", "id": "q3"}),
    ]
    path = _write_jsonl(tmp_path / "d.jsonl", lines)
    cfg = DataConfig(task="jsonl", path=path, prompt_field="question", answer_field="answer")
    with caplog.at_level(logging.WARNING):
        records = load_records(cfg, path)
    assert [r["prompt"] for r in records] == ["1+1?", "3+3?"]
    assert records[0]["uid"] == "d.jsonl:1"
    msg = caplog.text
    assert "skipped 4 of 6" in msg
    assert "malformed JSON: 1 (lines [2])" in msg
    assert "missing field 'answer': 1 (lines [3])" in msg
    assert "not a JSON object: 1 (lines [4])" in msg
    assert "empty field 'answer': 1 (lines [5])" in msg


def test_missing_mapped_field_fails_at_startup(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps({"q": "x", "a": "1"})] * 3)
    cfg = DataConfig(task="jsonl", path=path, prompt_field="question", answer_field="a", heldout_fraction=0)
    with pytest.raises(ValueError, match="required field 'question'"):
        make_prompt_iterator(cfg, TOK)


def test_parquet_source_and_missing_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "d.parquet")
    pq.write_table(
        pa.table({"problem": ["a", "b", None], "solution": ["x \\boxed{1}", "\\boxed{\\frac{1}{2}}", "y"]}),
        path,
    )
    cfg = DataConfig(task="math", path=path, heldout_fraction=0, id_field=None)
    recs = load_records(cfg, path)
    want = [("a", "x \\boxed{1}"), ("b", "\\boxed{\\frac{1}{2}}")]  # the solutions as given
    assert [(r["prompt"], r["answer"]) for r in recs] == want
    bad = DataConfig(task="parquet", path=path, prompt_field="question", answer_field="solution")
    with pytest.raises(ValueError, match="required field 'question' is not a column"):
        load_records(bad, path)


def test_gsm8k_solution_passes_to_the_reward_as_given(tmp_path):
    solution = "3 + 4 = <<3+4=7>>7 apples\n#### 1,007"
    gsm = _write_jsonl(tmp_path / "gsm.jsonl", [json.dumps({"question": "How many?", "answer": solution})])
    cfg = DataConfig(task="gsm8k", path=gsm, template="Q: {prompt}\nA:", heldout_fraction=0)
    (p,) = list(make_prompt_iterator(cfg, TOK))
    assert p.answer == solution and p.text == "Q: How many?\nA:" and TASK_REWARD[p.metadata["task"]] == "math"


def test_file_heldout_split_by_uid_hash(tmp_path):
    rows = [json.dumps({"prompt": f"p{i}", "answer": str(i)}) for i in range(200)]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(task="jsonl", path=path, heldout_fraction=0.2, shuffle=False)
    train = {p.uid for p in make_prompt_iterator(cfg, TOK)}
    test = {p.uid for p in held_out_prompts(cfg, TOK, 1000)}
    assert train.isdisjoint(test) and len(train) + len(test) == 200 and 15 <= len(test) <= 65


def test_chat_template_applied_when_tokenizer_has_one(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<eos>": 1, "<|user|>": 2, "<|assistant|>": 3, "hi": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": "<eos>"})
    )
    hf = HFTokenizer(str(tmp_path))
    cfg = DataConfig(task="arithmetic", num_train=3, system_prompt="sys")
    p = next(make_prompt_iterator(cfg, hf))
    assert p.text.startswith("<|system|> sys <|user|> ") and p.text.endswith("<|assistant|>")
    assert p.tokens[-1] == 3
    plain = next(
        make_prompt_iterator(DataConfig(task="arithmetic", num_train=3, use_chat_template=False), hf)
    )
    assert "<|user|>" not in plain.text


# ---- pipeline: epochs, shuffling, sharding, state -----------------------------------------------------


def test_epochs_reshuffle_and_cover_everything():
    cfg = DataConfig(task="arithmetic", num_train=20, num_epochs=3, seed=7)
    uids = [p.uid for p in make_prompt_iterator(cfg, TOK)]
    assert len(uids) == 60
    epochs = [uids[i * 20 : (i + 1) * 20] for i in range(3)]
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs) and epochs[0] != epochs[1]
    assert uids != [p.uid for p in make_prompt_iterator(DataConfig(**{**cfg.__dict__, "seed": 8}), TOK)]


def test_process_sharding_disjoint_and_complete():
    cfg = DataConfig(task="arithmetic", num_train=30)
    shards = [
        {p.uid for p in make_prompt_iterator(cfg, TOK, process_index=i, process_count=3)} for i in range(3)
    ]
    assert sum(map(len, shards)) == 30 and len(set.union(*shards)) == 30
    with pytest.raises(ValueError, match="process_index"):
        make_prompt_iterator(cfg, TOK, process_index=3, process_count=3)


def test_max_prompt_tokens_filters():
    cfg = DataConfig(task="arithmetic", digits=2, num_train=200, max_prompt_tokens=5)
    prompts = list(make_prompt_iterator(cfg, TOK))
    assert prompts and all(len(p.tokens) <= 5 for p in prompts) and len(prompts) < 200


def test_iterator_state_resumes_at_exact_next_prompt():
    cfg = DataConfig(task="arithmetic", num_train=13, num_epochs=3, seed=3)
    full = [p.uid for p in make_prompt_iterator(cfg, TOK)]
    it = make_prompt_iterator(cfg, TOK)
    head = [p.uid for p in _take(it, 17)]  # crosses the first epoch boundary
    state = it.get_state()
    resumed = make_prompt_iterator(cfg, TOK)
    resumed.set_state(state)
    tail = [p.uid for p in resumed]
    assert head + tail == full  # no repeat, no skip, same shuffle


def test_iterator_state_saved_with_orbax(tmp_path):
    import grain
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    cfg = DataConfig(task="countdown", num_train=11, num_epochs=2, seed=5)
    full = [p.text for p in make_prompt_iterator(cfg, TOK)]
    it = make_prompt_iterator(cfg, TOK)
    head = [p.text for p in _take(it, 9)]
    params = {"w": jnp.arange(4.0)}
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(
            9,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params), data=grain.checkpoint.CheckpointSave(it)
            ),
        )
        mngr.wait_until_finished()
    fresh = make_prompt_iterator(cfg, TOK)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        restored = mngr.restore(
            mngr.latest_step(),
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(params), data=grain.checkpoint.CheckpointRestore(fresh)
            ),
        )
    assert np.array_equal(restored["params"]["w"], params["w"])
    assert head + [p.text for p in fresh] == full


def test_config_validation():
    with pytest.raises(ValueError, match="task"):
        DataConfig(task="nope")
    with pytest.raises(ValueError, match="needs a path"):
        DataConfig(task="gsm8k")
    with pytest.raises(ValueError, match="operators"):
        DataConfig(operators="+/")
    with pytest.raises(ValueError, match="template"):
        DataConfig(template="no placeholder")
