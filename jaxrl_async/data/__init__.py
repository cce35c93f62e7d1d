"""Prompt data: sources (JSONL, Parquet, GSM8K, MATH, synthetic tasks) and the grain pipeline.

Exports load lazily: reward workers import `jaxrl_async.data.synthetic` for its verifiers and must not pay
for grain (which imports JAX).
"""

import importlib

_EXPORTS = {
    "DataConfig": "jaxrl_async.data.prompt",
    "Prompt": "jaxrl_async.data.prompt",
    "held_out_prompts": "jaxrl_async.data.sources",
    "load_records": "jaxrl_async.data.sources",
    "make_prompt_iterator": "jaxrl_async.data.sources",
    "prompt_at": "jaxrl_async.data.sources",
    "render_prompt": "jaxrl_async.data.sources",
    "arithmetic_reward": "jaxrl_async.data.synthetic",
    "countdown_reward": "jaxrl_async.data.synthetic",
    "countdown_verify": "jaxrl_async.data.synthetic",
    "reference_completion": "jaxrl_async.data.synthetic",
    "solve_countdown": "jaxrl_async.data.synthetic",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxrl_async.data' has no attribute {name!r}")
