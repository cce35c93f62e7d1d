"""Prompt sources (JSONL / Parquet with a field mapping, GSM8K and MATH field defaults, synthetic tasks) and
the grain pipeline: shard per process, seeded shuffle per epoch, repeat, render + tokenize.

A record's answer is the answer field's text as given (a GSM8K solution ending in `#### 72`, a MATH
solution with its `\\boxed{}`); the reward takes the final answer out of it (jaxrl_async.rewards.answers).

The iterator returned by `make_prompt_iterator` is a grain DatasetIterator: `get_state()`/`set_state()`
resume at the exact next prompt, and `grain.checkpoint.CheckpointSave/Restore` store it with orbax.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import grain
import numpy as np

from jaxrl_async import storage
from jaxrl_async.data.prompt import SYNTHETIC_TASKS, DataConfig, Prompt, is_heldout
from jaxrl_async.data.synthetic import synthetic_distinct, synthetic_example

log = logging.getLogger(__name__)

_SHOW_LINES = 20  # line numbers listed per skip reason in the warning
_UNPARSED = ("malformed JSON", "not a JSON object")


# ---- file loading -------------------------------------------------------------------------------------


def _rows_jsonl(path: str, skips: dict[str, list[int]]):
    """Yields (line number, dict) for well-formed lines; malformed ones are recorded in `skips`."""
    with storage.path(path).open("r", encoding="utf-8") as f:  # a gs:// path too
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                skips.setdefault(_UNPARSED[0], []).append(lineno)
                continue
            if not isinstance(row, dict):
                skips.setdefault(_UNPARSED[1], []).append(lineno)
                continue
            yield lineno, row


def _rows_parquet(path: str, required: list[str], skips: dict[str, list[int]]):
    import pyarrow.parquet as pq

    with storage.path(path).open("rb") as f:  # pyarrow's own gs:// support would bypass epath's settings
        table = pq.read_table(f)
    for name in required:
        if name not in table.column_names:
            raise ValueError(
                f"{path}: required field {name!r} is not a column; columns: {table.column_names}"
            )
    yield from enumerate(table.to_pylist(), start=1)


def load_records(cfg: DataConfig, path: str) -> list[dict[str, Any]]:
    """Reads `path` into raw records {uid, prompt, answer, metadata} using the config's field mapping.

    Malformed lines and rows missing a field are skipped, counted and reported (with line numbers) in one
    warning. A mapped field that no row has raises ValueError naming it.
    """
    prompt_field, answer_field = cfg.fields
    required = [prompt_field, answer_field, *([cfg.id_field] if cfg.id_field else []), *cfg.metadata_fields]
    parquet = cfg.task == "parquet" or path.endswith(".parquet")
    skips: dict[str, list[int]] = {}
    rows = _rows_parquet(path, required, skips) if parquet else _rows_jsonl(path, skips)
    seen_fields: set[str] = set()
    records, total = [], 0
    base = storage.path(path).name  # the same uids whether the file is local or in a bucket
    for lineno, row in rows:
        total += 1
        seen_fields.update(k for k, v in row.items() if v is not None)
        missing = [name for name in required if row.get(name) is None]
        if missing:
            skips.setdefault(f"missing field {missing[0]!r}", []).append(lineno)
            continue
        answer = str(row[answer_field]).strip()
        if not answer:
            skips.setdefault(f"empty field {answer_field!r}", []).append(lineno)
            continue
        uid = str(row[cfg.id_field]) if cfg.id_field else f"{base}:{lineno}"
        meta = {name: row[name] for name in cfg.metadata_fields}
        records.append({"uid": uid, "prompt": str(row[prompt_field]), "answer": answer, "metadata": meta})
    total += sum(len(skips.get(why, [])) for why in _UNPARSED)  # lines that never became rows
    absent = [name for name in required if name not in seen_fields]
    if absent:
        raise ValueError(
            f"{path}: required field {absent[0]!r} (from the field mapping) is in no row; "
            f"fields seen: {sorted(seen_fields)}"
        )
    if skips:
        detail = "; ".join(
            f"{why}: {len(lines)} (lines {lines[:_SHOW_LINES]}{' ...' if len(lines) > _SHOW_LINES else ''})"
            for why, lines in skips.items()
        )
        log.warning("%s: skipped %d of %d rows: %s", path, sum(map(len, skips.values())), total, detail)
    if not records:
        raise ValueError(f"{path}: no usable rows ({total} read)")
    return records


# ---- rendering ----------------------------------------------------------------------------------------


def render_prompt(cfg: DataConfig, tokenizer, raw_prompt: str) -> tuple[str, np.ndarray]:
    """Applies the template (and the tokenizer's chat template when it has one); returns (text, tokens)."""
    text = cfg.template.format(prompt=raw_prompt)
    if cfg.use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []) + [
            {"role": "user", "content": text}
        ]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = tokenizer.encode(text)
    bos = getattr(tokenizer, "bos_id", None)
    if cfg.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids = [bos, *ids]
    return text, np.asarray(ids, dtype=np.int32)


def to_prompt(cfg: DataConfig, tokenizer, record: dict[str, Any]) -> Prompt:
    """Turns a raw record into a tokenized Prompt whose metadata is ready for the reward service."""
    text, tokens = render_prompt(cfg, tokenizer, record["prompt"])
    meta = {**record["metadata"], "answer": record["answer"], "task": cfg.task}
    key = f"{record.get('epoch', 0)}:{record['row']}" if "row" in record else ""
    answer = record["answer"]
    weight = float(record.get("weight", 1.0))
    return Prompt(record["uid"], text, tokens, answer, meta, key=key, weight=weight)


# ---- datasets -----------------------------------------------------------------------------------------


def _file_records(cfg: DataConfig, split: str) -> list[dict[str, Any]]:
    if cfg.eval_path:
        return load_records(cfg, cfg.path if split == "train" else cfg.eval_path)
    records = load_records(cfg, cfg.path)
    if split == "test" and cfg.heldout_fraction <= 0:
        raise ValueError("DataConfig: no held-out split (set eval_path or heldout_fraction > 0)")
    return [r for r in records if is_heldout(r["uid"], cfg.heldout_fraction) == (split == "test")]


def raw_dataset(cfg: DataConfig, split: str = "train") -> grain.MapDataset:
    """One epoch of raw records of `split` ("train" or "test"), unshuffled and unsharded."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if cfg.task in SYNTHETIC_TASKS:
        if split == "test":
            return grain.MapDataset.source(synthetic_distinct(cfg, cfg.num_eval))
        return grain.MapDataset.range(cfg.num_train).map(lambda i: synthetic_example(cfg, "train", i))
    return grain.MapDataset.source(_file_records(cfg, split))


def make_prompt_iterator(
    cfg: DataConfig, tokenizer, *, split: str = "train", process_index: int = 0, process_count: int = 1
) -> grain.DatasetIterator:
    """A checkpointable iterator of Prompts for this process.

    Args:
      cfg: data configuration.
      tokenizer: anything with `encode` (and optionally `chat_template`/`apply_chat_template`, `bos_id`).
      split: "train" (shuffled per epoch, `cfg.num_epochs` passes) or "test" (held-out, one ordered pass).
      process_index, process_count: this host's disjoint shard (records process_index::process_count).

    Returns:
      A grain DatasetIterator with get_state()/set_state(); exhausted after the last epoch.
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    ds = raw_dataset(cfg, split)[process_index::process_count]
    n = len(ds)
    if n == 0:
        raise ValueError(f"process {process_index} of {process_count} gets no {split} records")
    ds = ds.map_with_index(lambda i, rec: {**rec, "row": i % n})  # i runs on across epochs
    if split == "train":
        if cfg.shuffle:
            ds = ds.shuffle(seed=cfg.seed)  # grain reshuffles with a fresh permutation every epoch
        ds = ds.repeat(cfg.num_epochs)
        ds = ds.map_with_index(lambda i, rec: {**rec, "epoch": i // n})
    ds = ds.map(lambda rec: to_prompt(cfg, tokenizer, rec))
    if cfg.max_prompt_tokens is not None:
        ds = ds.filter(lambda p: len(p.tokens) <= cfg.max_prompt_tokens)
    # Few threads: prompts are cheap, and the sampler's host loop should keep the cores.
    read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=32)
    return iter(ds.to_iter_dataset(read_options=read))


def prompt_at(cfg: DataConfig, tokenizer, key: str) -> Prompt:
    """The training prompt a ledger key ("<epoch>:<row>", see `Prompt.key`) names."""
    epoch, row = (int(x) for x in key.split(":"))
    return to_prompt(cfg, tokenizer, {**raw_dataset(cfg, "train")[row], "row": row, "epoch": epoch})


def held_out_prompts(cfg: DataConfig, tokenizer, n: int, split: str = "test") -> list[Prompt]:
    """The first `n` held-out prompts (distinct, fixed order; fewer if the split is smaller). The
    letter-range task's carry weights: its held-out accuracy is a weighted mean (jaxrl_async.data.letter_range
    says why). split="train" gives the training split's prompts the same way (distinct, weighted): scored
    beside the held-out ones they show how much of what RL learned carries over to unseen problems."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if cfg.task in SYNTHETIC_TASKS:
        records = synthetic_distinct(cfg, n, split)
    else:
        records = _file_records(cfg, split)[:n]
    return [to_prompt(cfg, tokenizer, r) for r in records]
