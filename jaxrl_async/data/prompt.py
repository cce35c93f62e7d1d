"""The prompt record the pipeline yields, and the data configuration."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

TASKS = ("arithmetic", "countdown", "shift", "letter_range", "calc_tool", "jsonl", "parquet", "gsm8k", "math")
SYNTHETIC_TASKS = ("arithmetic", "countdown", "shift", "letter_range", "calc_tool")
# (prompt field, answer field) for each file task unless DataConfig overrides them.
DEFAULT_FIELDS = {
    "jsonl": ("prompt", "answer"),
    "parquet": ("prompt", "answer"),
    "gsm8k": ("question", "answer"),
    "math": ("problem", "solution"),
}


@dataclasses.dataclass(frozen=True, eq=False)
class Prompt:
    """One prompt ready for the sampler.

    Attributes:
      uid: stable identity of the example (the same across epochs).
      text: the rendered prompt (template and chat template applied).
      tokens: int32 token ids of `text`.
      answer: the reference answer: the synthetic task's result, or a file's answer field as given (a
        GSM8K or MATH solution included: the reward takes the final answer out of it).
      metadata: what the reward function receives; always holds "answer" and "task" (and "reward" when
        the row names its own reward: it overrides the run's, config.reward.reward).
      key: this draw of the example in the training stream, "<epoch>:<row>" (row: its index in one
        epoch of the source, before shuffling); the coordinator's ledger and trained_uids.jsonl use it.
      weight: the prompt's weight in a held-out accuracy (a weighted mean): 1 except where a task's
        held-out set lists distinct prompts with their probabilities (letter_range).
    """

    uid: str
    text: str
    tokens: np.ndarray
    answer: str
    metadata: Mapping[str, Any]
    key: str = ""
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where prompts come from and how they are rendered, shuffled and split.

    Attributes:
      task: "arithmetic" | "countdown" | "shift" | "letter_range" | "calc_tool" (built in, no files) |
        "jsonl" | "parquet" | "gsm8k" | "math".
      path: data file for file tasks (.jsonl/.json or .parquet; gsm8k/math accept either).
      eval_path: optional held-out file; without it file tasks hold out `heldout_fraction` by uid hash.
      prompt_field, answer_field: field mapping (defaults per task in DEFAULT_FIELDS).
      id_field: field giving the uid (default "<file name>:<line or row number>").
      metadata_fields: extra fields copied into Prompt.metadata (e.g. "tests" for code tasks).
      template: Python format string with {prompt}, applied before the chat template.
      system_prompt: optional system message for the chat template.
      use_chat_template: apply the tokenizer's chat template when it has one.
      add_bos: prepend the tokenizer's bos id (when it has one and the text does not already carry it).
      seed: shuffling and synthetic generation seed.
      shuffle: reshuffle every epoch (the "test" split is never shuffled).
      num_epochs: passes over the data; None repeats forever.
      max_prompt_tokens: drop prompts longer than this (None keeps all).
      heldout_fraction: share of examples (by stable hash) reserved for the held-out split.
      digits, operators: arithmetic operands in [0, 10**digits) with operators from "+-*"; for the
        shift task, the length of the digit string (and of the answer); for calc_tool, the digits of the
        first factor (and of the added number), the second factor having two (operators unused).
      num_train: synthetic examples per epoch.
      num_eval: size of a synthetic task's "test" split iterator.
      countdown_numbers, countdown_max_number, countdown_max_target: countdown puzzle sizes.
      letter_span_power: letter-range spans are exp(u^p ln 53), u uniform: 1 is log-uniform on 1..52,
        larger values make short ranges commoner (jaxrl_async.data.letter_range).
      letter_heldout_min_span: letter ranges shorter than this many letters are never held out (all of
        them train); 1 holds out every span alike.
    """

    task: str = "arithmetic"
    path: str | None = None
    eval_path: str | None = None
    prompt_field: str | None = None
    answer_field: str | None = None
    id_field: str | None = None
    metadata_fields: tuple[str, ...] = ()
    template: str = "{prompt}"
    system_prompt: str | None = None
    use_chat_template: bool = True
    add_bos: bool = False
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = 1
    max_prompt_tokens: int | None = None
    heldout_fraction: float = 0.1
    digits: int = 2
    operators: str = "+"
    num_train: int = 100_000
    num_eval: int = 1000
    countdown_numbers: int = 3
    countdown_max_number: int = 20
    countdown_max_target: int = 100
    letter_span_power: float = 1.0
    letter_heldout_min_span: int = 1

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"DataConfig: task must be one of {TASKS}, got {self.task!r}")
        if self.task not in SYNTHETIC_TASKS and not self.path:
            raise ValueError(f"DataConfig: task {self.task!r} needs a path")
        if self.task == "jsonl" and self.path and self.path.endswith(".parquet"):
            raise ValueError("DataConfig: task 'jsonl' with a .parquet path; use task='parquet'")
        if "{prompt}" not in self.template:
            raise ValueError(f"DataConfig: template must contain {{prompt}}, got {self.template!r}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"DataConfig: num_epochs must be >= 1 or None, got {self.num_epochs}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"DataConfig: heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        most = 64 if self.task == "shift" else 9  # shift: the answer's length; arithmetic: operand digits
        if not 1 <= self.digits <= most:
            raise ValueError(f"DataConfig: digits must be in [1, {most}] ({self.task}), got {self.digits}")
        if (
            not self.operators
            or set(self.operators) - set("+-*")
            or len(set(self.operators)) != len(self.operators)
        ):
            raise ValueError(
                f"DataConfig: operators must be distinct characters of '+-*', got {self.operators!r}"
            )
        if self.num_train < 1 or self.num_eval < 1:
            raise ValueError(
                f"DataConfig: num_train and num_eval must be >= 1, got {self.num_train}, {self.num_eval}"
            )
        if not 2 <= self.countdown_numbers <= 6:
            raise ValueError(f"DataConfig: countdown_numbers must be in [2, 6], got {self.countdown_numbers}")
        if self.countdown_max_number < 2 or self.countdown_max_target < 1:
            raise ValueError("DataConfig: countdown_max_number must be >= 2 and countdown_max_target >= 1")
        if not 0.25 <= self.letter_span_power <= 4.0:
            raise ValueError(
                f"DataConfig: letter_span_power must be in [0.25, 4], got {self.letter_span_power}"
            )
        if not 1 <= self.letter_heldout_min_span <= 52:
            raise ValueError(
                f"DataConfig: letter_heldout_min_span must be in [1, 52], got {self.letter_heldout_min_span}"
            )
        letter_knobs = self.letter_span_power != 1.0 or self.letter_heldout_min_span != 1
        if letter_knobs and self.task != "letter_range":  # only that task reads them: refused, not ignored
            raise ValueError(
                "DataConfig: letter_span_power and letter_heldout_min_span apply to task 'letter_range' "
                f"only, got task {self.task!r}"
            )
        if self.task in SYNTHETIC_TASKS and self.heldout_fraction <= 0.0:
            raise ValueError("DataConfig: synthetic tasks need heldout_fraction > 0 for their held-out split")

    @property
    def fields(self) -> tuple[str, str]:
        """(prompt field, answer field) after defaults."""
        default = DEFAULT_FIELDS.get(self.task, (None, None))
        return self.prompt_field or default[0], self.answer_field or default[1]


def unit_hash(key: str) -> float:
    """A stable hash of `key` mapped to [0, 1) (independent of PYTHONHASHSEED)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def is_heldout(key: str, fraction: float) -> bool:
    """Whether the example identified by `key` belongs to the held-out split."""
    return unit_hash("heldout:" + key) < fraction
