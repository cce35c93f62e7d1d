"""Loading a checkpoint for generation, and the prompt and stop-token conventions of the generate CLI and
the server (so both turn the same text into the same tokens)."""

from __future__ import annotations

import os

from jaxrl_async.model import ModelConfig, load_hf
from jaxrl_async.runtime.checkpoint import find_checkpoints, load_policy
from jaxrl_async.sharding import SAMPLER_RULES
from jaxrl_async.tokenizer import CharTokenizer, Tokenizer


def load_checkpoint(path: str, mesh, dtype: str = "float32", step: int | None = None):
    """(ModelConfig, params on `mesh` in the sampler layout, default tokenizer) from a checkpoint.

    Args:
      path: a Hugging Face directory (config.json + safetensors), or one of our runs (its workdir, its
        checkpoints/ directory or a step in it).
      dtype: the parameter dtype of a Hugging Face checkpoint (a run's checkpoint keeps its own).
      step: the policy version of a run (default: the newest, or the step directory's).

    Returns:
      the tokenizer is the Hugging Face directory itself, or what the run recorded (a directory or "char").

    Raises:
      FileNotFoundError: `path` is neither a Hugging Face directory nor one of our runs.
    """
    if os.path.exists(os.path.join(path, "config.json")):
        model_cfg, params = load_hf(path, dtype=dtype, mesh=mesh, rules=SAMPLER_RULES, param_dtype=dtype)
        return model_cfg, params, path
    if find_checkpoints(path) is None:
        raise FileNotFoundError(
            f"--checkpoint {path}: neither a Hugging Face directory (config.json) nor a run of ours "
            "(model.json in it, in its checkpoints/ or beside it)"
        )
    model_cfg, params, tokenizer, version = load_policy(path, mesh, SAMPLER_RULES, step)
    print(f"policy version {version} from {find_checkpoints(path)}")
    return model_cfg, params, tokenizer


def encode_prompt(tok: Tokenizer, text: str) -> list[int]:
    """`text` as prompt tokens: BOS first when the tokenizer has one (once), except for the character
    tokenizer, whose synthetic tasks are trained without it."""
    prompt = tok.encode(text)
    if tok.bos_id is not None and not isinstance(tok, CharTokenizer) and prompt[:1] != [tok.bos_id]:
        prompt = [tok.bos_id, *prompt]
    return prompt


def stop_tokens(tok: Tokenizer | None, model_cfg: ModelConfig) -> tuple[int, ...]:
    """Token ids that end a completion: the tokenizer's EOS and the model config's."""
    return tuple(sorted({t for t in (tok and tok.eos_id, model_cfg.eos_token_id) if t is not None}))
