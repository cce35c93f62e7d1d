"""Prompt data: sources (JSONL, Parquet, GSM8K, MATH, synthetic tasks) and the grain pipeline.

Grading lives in jaxrl_async.rewards, which reads what it needs from `Prompt.metadata`; neither package
imports the other.
"""

from jaxrl_async.data.prompt import DataConfig, Prompt
from jaxrl_async.data.sources import (
    held_out_prompts,
    load_records,
    make_prompt_iterator,
    prompt_at,
    render_prompt,
)
from jaxrl_async.data.synthetic import reference_completion, solve_countdown

__all__ = [
    "DataConfig",
    "Prompt",
    "held_out_prompts",
    "load_records",
    "make_prompt_iterator",
    "prompt_at",
    "reference_completion",
    "render_prompt",
    "solve_countdown",
]
