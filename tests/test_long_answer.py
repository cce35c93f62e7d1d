"""The long-answer task (shift): its prompts, answers of tens of tokens, its reward, and its config."""

import jax

from configs import long_answer
from jaxrl_async.data import DataConfig, held_out_prompts, make_prompt_iterator, reference_completion
from jaxrl_async.rewards.registry import get_reward
from jaxrl_async.run_config import validate
from jaxrl_async.tokenizer import CharTokenizer


def test_shift_task_generates_long_answers_and_grades_them(tmp_path):
    cfg = DataConfig(task="shift", digits=24, seed=3)
    tok = CharTokenizer()
    it = make_prompt_iterator(cfg, tok)
    prompts = [next(it) for _ in range(8)]
    for p in prompts:
        answer = p.metadata["answer"]
        assert p.text.startswith("shift ") and len(answer) == 24
        assert reference_completion(p.text) == answer
        assert len(tok.encode(answer)) == 24  # tens of tokens: updates land mid-sequence
        assert all((int(a) - int(b)) % 10 == 1 for a, b in zip(answer, p.text[6:30], strict=True))
    held = held_out_prompts(cfg, tok, 16)
    assert len({p.text for p in held}) == 16 and not {p.text for p in held} & {p.text for p in prompts}
    grade = get_reward("shift")
    meta = prompts[0].metadata
    assert grade(prompts[0].text, meta["answer"], meta) == 1.0
    half = meta["answer"][:12] + "".join(str((int(d) + 5) % 10) for d in meta["answer"][12:])
    assert grade(prompts[0].text, half, meta) == 0.5
    assert grade(prompts[0].text, meta["answer"] + "77", meta) < 1.0  # extra characters cost
    assert grade(prompts[0].text, "", meta) == 0.0


def test_long_answer_config_validates(tmp_path):
    c = long_answer.get_config()
    c.workdir = str(tmp_path)
    run = validate(c, len(jax.devices()))
    assert run.data.task == "shift" and run.reward.reward == "shift"
    assert run.sampler.max_new_tokens >= 24 > run.sampler.steps_per_call
