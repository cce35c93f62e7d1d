"""Rollouts -> fixed-shape micro-batches: first-fit-decreasing packing into token-budget rows.

A sequence of P prompt and C completion tokens occupies P + C - 1 row positions: inputs are its tokens
but the last, targets are its tokens shifted by one, and the loss mask covers the C targets that are
completion tokens, less the observation tokens of a multi-turn episode (`model_mask` False): those are
inputs like the prompt, with loss mask, behaviour logprob, version and advantage all 0, so the loss, the
KL and every per-token statistic (all weighted by the loss mask) leave them out. Packed rows have the
fixed shape [rows_per_micro, token_budget] (segment id 0 = padding; positions restart at 0 in every
segment), so the train step compiles once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

FIELDS = (
    "tokens",
    "targets",
    "positions",
    "segment_ids",
    "loss_mask",
    "behav_logp",
    "versions",
    "advantages",
)
FIELD_DTYPES = {
    "tokens": np.int32,
    "targets": np.int32,
    "positions": np.int32,
    "segment_ids": np.int32,
    "loss_mask": np.float32,
    "behav_logp": np.float32,
    "versions": np.int32,
    "advantages": np.float32,
}


class TrainSample(Protocol):
    """What the trainer reads of one sampled sequence: the run's record is `jaxrl_async.rollouts.Rollout`.

    Attributes:
      prompt_tokens: [P] int token ids (P >= 1).
      completion_tokens: [C] int token ids (C >= 1).
      behav_logprobs: [C] sampler logprobs of the completion tokens.
      versions: [C] policy version that sampled each completion token.
      reward: scalar reward.
      group_id: int; sequences sampled from the same prompt share it.
      model_mask (optional; None or absent = all True): [C] bool, False for observation tokens (an
        environment's answers in a multi-turn episode), which the loss leaves out.
    """

    prompt_tokens: Sequence[int]
    completion_tokens: Sequence[int]
    behav_logprobs: Sequence[float]
    versions: Sequence[int]
    reward: float
    group_id: int


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Micro-batches stacked on a leading axis: every field is [M, rows_per_micro, token_budget].

    Attributes:
      arrays: FIELDS -> numpy array [M, R, S].
      num_sequences: sequences in the batch.
      num_loss_tokens: completion tokens (loss-mask ones) in the batch.
      num_skipped: sequences left out before packing (zero advantage, see TrainConfig).
      updates: micro-batches per optimizer update, in order (they sum to M); () = one update of all.
    """

    arrays: dict
    num_sequences: int
    num_loss_tokens: int
    num_skipped: int = 0
    updates: tuple[int, ...] = ()

    @property
    def num_micro(self) -> int:
        return self.arrays["tokens"].shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        """(rows_per_micro, token_budget) of one micro-batch."""
        return tuple(self.arrays["tokens"].shape[1:])

    def micro_batch(self, i: int) -> dict:
        """Micro-batch i: FIELDS -> [R, S]."""
        return {k: v[i] for k, v in self.arrays.items()}

    def update_groups(self) -> list[range]:
        """The micro-batch indices of each optimizer update (one update of all when `updates` is ())."""
        counts = self.updates or (self.num_micro,)
        if sum(counts) != self.num_micro:
            raise ValueError(f"updates {counts} do not add up to the {self.num_micro} micro-batches")
        starts = np.cumsum((0,) + tuple(counts))
        return [range(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:], strict=True)]


def ffd_bins(
    lengths: Sequence[int],
    capacity: int,
    min_bins: int = 1,
    bins_multiple: int = 1,
    max_items: int | None = None,
) -> list[list[int]]:
    """Assigns items to bins of `capacity`, longest first (AReaL's first-fit-decreasing variant).

    Each item, in decreasing length, goes to a new bin while fewer than `min_bins` exist or when no bin
    has room; otherwise to the bin with room holding the fewest items (ties: the earliest bin), which
    spreads sequences (and so attention cost) evenly. The bin count is rounded up to a multiple of
    `bins_multiple` by raising `min_bins` (empty bins only when there are too few items). A bin holding
    `max_items` items (None = no limit) takes no more.

    Raises:
      ValueError: an item is longer than `capacity`, or max_items < 1.
    """
    lengths = [int(x) for x in lengths]
    if any(x > capacity for x in lengths):
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the token budget {capacity}")
    if max_items is not None and max_items < 1:
        raise ValueError(f"max_items must be >= 1 or None, got {max_items}")
    full = len(lengths) + 1 if max_items is None else max_items
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    min_bins = max(min_bins, bins_multiple, 1)
    while True:
        bins: list[list[int]] = []
        loads: list[int] = []
        for i in order:
            fits = [b for b in range(len(bins)) if loads[b] + lengths[i] <= capacity and len(bins[b]) < full]
            if len(bins) < min_bins or not fits:
                bins.append([i])
                loads.append(lengths[i])
                continue
            b = min(fits, key=lambda j: (len(bins[j]), j))
            bins[b].append(i)
            loads[b] += lengths[i]
        if len(bins) % bins_multiple == 0:
            return bins
        if len(bins) >= len(lengths):
            bins.extend([] for _ in range(-len(bins) % bins_multiple))
            return bins
        min_bins = len(bins) + (-len(bins) % bins_multiple)


def _sequence_fields(r: TrainSample, advantage: float) -> dict:
    prompt = np.asarray(r.prompt_tokens, np.int32).reshape(-1)
    completion = np.asarray(r.completion_tokens, np.int32).reshape(-1)
    behav = np.asarray(r.behav_logprobs, np.float32).reshape(-1)
    versions = np.asarray(r.versions, np.int32).reshape(-1)
    if prompt.size < 1 or completion.size < 1:
        raise ValueError("a rollout needs at least one prompt and one completion token")
    if behav.size != completion.size or versions.size != completion.size:
        raise ValueError(
            f"behav_logprobs ({behav.size}) and versions ({versions.size}) must match the "
            f"{completion.size} completion tokens"
        )
    model = getattr(r, "model_mask", None)
    model = np.ones(completion.size, bool) if model is None else np.asarray(model, bool).reshape(-1)
    if model.size != completion.size:
        raise ValueError(f"model_mask ({model.size}) must match the {completion.size} completion tokens")
    full = np.concatenate([prompt, completion])
    n = full.size - 1
    p = prompt.size - 1  # first position whose target is a completion token
    pad_f = lambda x, dtype: np.concatenate([np.zeros(p, dtype), np.where(model, x, 0).astype(dtype)])
    return {
        "tokens": full[:-1],
        "targets": full[1:],
        "positions": np.arange(n, dtype=np.int32),
        "loss_mask": pad_f(np.ones(completion.size, np.float32), np.float32),
        "behav_logp": pad_f(behav, np.float32),
        "versions": pad_f(versions, np.int32),
        # Prompt positions keep the advantage as before (the loss mask hides them); observations get 0.
        "advantages": np.concatenate([np.full(p, advantage), np.where(model, advantage, 0.0)]).astype(
            np.float32
        ),
    }


def sequence_length(r: TrainSample) -> int:
    """Row positions a rollout occupies (prompt + completion - 1)."""
    return len(r.prompt_tokens) + len(r.completion_tokens) - 1


def _fill(rollouts, advantages, rows: list[list[int]], rows_per_micro: int, row_len: int) -> PackedBatch:
    n_micro = max(1, -(-len(rows) // rows_per_micro))
    shape = (n_micro * rows_per_micro, row_len)
    out = {k: np.zeros(shape, FIELD_DTYPES[k]) for k in FIELDS}
    tokens = 0
    for row, members in enumerate(rows):
        start = 0
        for seg, i in enumerate(members, start=1):
            f = _sequence_fields(rollouts[i], float(advantages[i]))
            n = f["tokens"].size
            for k, v in f.items():
                out[k][row, start : start + n] = v
            out["segment_ids"][row, start : start + n] = seg
            tokens += int(f["loss_mask"].sum())
            start += n
    arrays = {k: v.reshape(n_micro, rows_per_micro, row_len) for k, v in out.items()}
    return PackedBatch(arrays, num_sequences=len(rollouts), num_loss_tokens=tokens)


def pack_rollouts(
    rollouts: Sequence[TrainSample],
    advantages,
    token_budget: int,
    rows_per_micro: int = 1,
    min_micro: int = 1,
    max_row_segments: int | None = None,
) -> PackedBatch:
    """Packs rollouts into micro-batches of `rows_per_micro` rows of `token_budget` positions.

    Args:
      rollouts: TrainSamples (the run's `jaxrl_async.rollouts.Rollout`s).
      advantages: [N] per-sequence advantages (broadcast to the sequence's completion tokens).
      token_budget: positions per packed row (the compiled sequence length).
      rows_per_micro: rows per micro-batch (a multiple of the trainer mesh's fsdp size).
      min_micro: at least this many micro-batches (e.g. the number of PPO minibatches).
      max_row_segments: at most this many sequences per row (None = as many as fit): the attention's own
        limit, `model.attention.row_segment_cap` (cuDNN's packed layout is built for a fixed count).

    Returns:
      A PackedBatch; a sequence never spans two rows, so per-sequence losses stay exact.
    """
    if len(rollouts) != len(advantages):
        raise ValueError(f"{len(rollouts)} rollouts but {len(advantages)} advantages")
    lengths = [sequence_length(r) for r in rollouts]
    rows = ffd_bins(lengths, token_budget, min_micro * rows_per_micro, rows_per_micro, max_row_segments)
    return _fill(rollouts, advantages, rows, rows_per_micro, token_budget)


def pad_rollouts(
    rollouts: Sequence[TrainSample], advantages, row_len: int | None = None, rows_per_micro: int = 1
) -> PackedBatch:
    """The padded baseline: one sequence per row of `row_len` (default: the longest sequence)."""
    lengths = [sequence_length(r) for r in rollouts]
    row_len = max(lengths) if row_len is None else row_len
    if max(lengths) > row_len:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the row length {row_len}")
    return _fill(rollouts, advantages, [[i] for i in range(len(rollouts))], rows_per_micro, row_len)


def split_groups(group_ids: Sequence[int], lengths: Sequence[int], parts: int, seed: int) -> list[list[int]]:
    """Splits a batch's sequences into `parts` disjoint shares of whole groups, token-balanced.

    The groups (sequences sharing a group id) are visited in a seeded random order and each goes to the
    share holding the fewest tokens so far (ties: the first), so every share gets at least one group,
    the shares differ by at most one group's tokens, and which groups share an update is not decided by
    their lengths. Returns each share's sequence indices in increasing order.

    Raises:
      ValueError: fewer groups than `parts` (the message names config.trainer.minibatches).
    """
    order_of: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        order_of.setdefault(int(g), []).append(i)
    groups = list(order_of.values())
    if len(groups) < parts:
        raise ValueError(
            f"config.trainer.minibatches={parts}: the batch holds only {len(groups)} groups, and each "
            "optimizer update needs at least one whole group (lower minibatches or raise prompts_per_step)"
        )
    loads = np.zeros(parts, np.int64)
    shares: list[list[int]] = [[] for _ in range(parts)]
    for g in np.random.default_rng(seed).permutation(len(groups)):
        b = int(np.argmin(loads))
        shares[b].extend(groups[g])
        loads[b] += sum(int(lengths[i]) for i in groups[g])
    return [sorted(s) for s in shares]


def batch_seed(seed: int, group_ids: Sequence[int]) -> int:
    """A split seed from the config's seed and the batch's group ids: every trainer process derives the
    same one from the same batch, and paired runs (same data, same seed) split their batches alike."""
    ids = sorted({int(g) % 2**32 for g in group_ids})
    return int(np.random.SeedSequence([int(seed) % 2**32, *ids]).generate_state(1)[0])


def pack_minibatches(
    rollouts: Sequence[TrainSample],
    advantages,
    token_budget: int,
    rows_per_micro: int,
    minibatches: int,
    seed: int,
    max_row_segments: int | None = None,
) -> PackedBatch:
    """`minibatches` disjoint shares of whole groups (see split_groups), each packed into micro-batches
    of its own (at most `max_row_segments` sequences per row, see pack_rollouts); the result's `updates`
    says how many micro-batches each optimizer update takes."""
    if len(rollouts) != len(advantages):
        raise ValueError(f"{len(rollouts)} rollouts but {len(advantages)} advantages")
    advantages = np.asarray(advantages, np.float32)
    lengths = [sequence_length(r) for r in rollouts]
    shares = split_groups([r.group_id for r in rollouts], lengths, minibatches, seed)
    parts = [
        pack_rollouts(
            [rollouts[i] for i in s], advantages[s], token_budget, rows_per_micro, 1, max_row_segments
        )
        for s in shares
    ]
    arrays = {k: np.concatenate([p.arrays[k] for p in parts]) for k in FIELDS}
    return PackedBatch(
        arrays,
        num_sequences=len(rollouts),
        num_loss_tokens=sum(p.num_loss_tokens for p in parts),
        updates=tuple(p.num_micro for p in parts),
    )
