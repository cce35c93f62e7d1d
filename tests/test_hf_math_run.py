"""The real-model path of configs/qwen_1p5b_math.py in miniature: a run started from a Hugging Face
checkpoint directory (weights, config.json, a tokenizer with a chat template), prompts from a JSONL math
set, graded by the math reward (math-verify)."""

import json
import os

import jax
import pytest
from test_orchestrator import _small

from jaxrl_async.model import init_params, presets, save_hf
from jaxrl_async.runtime.orchestrator import run_from_config
from jaxrl_async.runtime.weight_sync import checksum
from jaxrl_async.tokenizer import CharTokenizer

# Only characters of the char vocabulary: the template's text must be encodable.
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _checkpoint(path) -> float:
    """A tiny Llama with the char tokenizer's files and a chat template; returns its weights' checksum."""
    tok = CharTokenizer()
    tok.save_hf(str(path))
    with open(path / "tokenizer_config.json") as f:
        tok_cfg = json.load(f)
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({**tok_cfg, "chat_template": TEMPLATE}, f)
    cfg = presets.tiny(vocab_size=tok.vocab_size, n_layers=2, max_seq_len=64)
    params = init_params(cfg, jax.random.key(5))
    save_hf(cfg, params, str(path))
    return checksum(params)


def test_run_from_a_hf_checkpoint_with_a_chat_template_on_a_jsonl_math_set(tmp_path):
    ckpt = tmp_path / "ckpt"
    start = _checkpoint(ckpt)
    rows = [{"problem": f"What is {a} + {b}?", "solution": f"The sum is \\boxed{{{a + b}}}."}
            for a in range(1, 9) for b in range(1, 9)]  # fmt: skip
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    over = {
        "model.checkpoint": str(ckpt), "model.n_layers": 0, "tokenizer": "",
        "data.task": "math", "data.path": str(data), "data.heldout_fraction": 0.25, "reward.reward": "",
        "reward.defaults": {}, "sampler.max_prompt_len": 40, "sampler.prompt_buckets": (40,),
        "trainer.token_budget": 64, "mode": "sync", "total_steps": 2, "eval_every": 0, "eval_prompts": 4,
        "verify_weights": True,
    }  # fmt: skip
    summary = run_from_config(_small(tmp_path / "run", **over))
    assert summary["steps"] == 2
    # RL started from the checkpoint's weights (version 0), and the sampler held each version.
    assert summary["weight_checksums"]["learner"][0] == pytest.approx(start, rel=1e-6)
    assert summary["weight_checksums"]["actors"][0] == summary["weight_checksums"]["learner"]
    # Every completion (training and held-out) went through the math reward without an error.
    stats = summary["reward_stats"]
    assert stats["graded"] == stats["ok"] > 0 and not stats["errors"]
    # The prompts the sampler saw were chat-templated (the sample texts the run writes to TensorBoard).
    samples = _texts(os.path.join(tmp_path, "run", "tb"))
    assert samples and all("'<user>What is " in t and "?\\n<assistant>' -> " in t for t in samples), samples


def _texts(logdir: str) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"tensors": 0})
    acc.Reload()
    tags = [t for t in acc.Tags()["tensors"] if t.startswith("samples")]
    return [e.tensor_proto.string_val[0].decode() for tag in tags for e in acc.Tensors(tag)]
