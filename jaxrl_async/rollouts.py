"""Rollout records, AReaL's staleness admission rule and the rollout queue between sampler and trainer.

Staleness is measured against the trainer's version when a sample is trained on:
  head staleness  = trainer version - the version that produced the sample's first token;
  token staleness = trainer version - the version that produced each token (in-flight updates make late
                    tokens of a long answer fresher than its head).
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

import numpy as np

# The version stamp of observation tokens (an environment's answer inside a multi-turn episode): no
# policy produced them.
OBSERVATION_VERSION = -1


@dataclasses.dataclass
class Rollout:
    """One graded completion with everything the trainer needs.

    A multi-turn episode's completion interleaves model turns and observations (`model_mask` False):
    observation tokens carry behaviour logprob 0 and version OBSERVATION_VERSION, and the trainer masks
    them out of the loss, the advantage, the KL and every per-token statistic.
    """

    uid: str  # the prompt's id
    group_id: int  # admission order of the prompt (samples of one prompt share it)
    sample_index: int
    prompt_tokens: np.ndarray  # int32 [P]
    completion_tokens: np.ndarray  # int32 [N] completion tokens (stop token included when emitted)
    behav_logprobs: np.ndarray  # float32 [N] behaviour logprobs
    versions: np.ndarray  # int32 [N] policy version that produced each token
    reward: float = 0.0
    finish_reason: str = ""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    model_mask: np.ndarray | None = None  # bool [N]: True = a model token; None = every token is

    @property
    def model_versions(self) -> np.ndarray:
        """The versions of the model's tokens (observations have none)."""
        return self.versions if self.model_mask is None else self.versions[np.asarray(self.model_mask, bool)]

    @property
    def start_version(self) -> int:
        versions = self.model_versions
        return int(versions[0]) if len(versions) else 0

    @classmethod
    def for_trainer(cls, prompt_tokens, completion_tokens, behav_logprobs, versions, reward: float,
                    group_id: int) -> Rollout:  # fmt: skip
        """A record holding only what the trainer reads (benchmarks and tests build batches so)."""
        return cls(uid="", group_id=group_id, sample_index=0, prompt_tokens=np.asarray(prompt_tokens),
                   completion_tokens=np.asarray(completion_tokens), behav_logprobs=np.asarray(behav_logprobs),
                   versions=np.asarray(versions), reward=float(reward))  # fmt: skip


@dataclasses.dataclass
class StalenessController:
    """AReaL's admission rule: the n-th prompt (1-based) starts only while floor((n-1)/B) <= version + η.

    η = 0 is synchronous RL: the B prompts of version v all start before v's update and none after.
    Prompts filtered out after sampling (dynamic sampling: groups whose rewards are all equal) return
    their budget: n counts the prompts started minus those filtered, so the bound holds for the groups
    that are trained, however many were sampled to find them.
    """

    batch_prompts: int  # B: prompts per train batch
    max_staleness: int  # η
    started: int = 0  # prompts admitted so far (the next admission number)
    filtered: int = 0  # of which filtered out after sampling (their budget is free again)

    def __post_init__(self):
        if self.batch_prompts <= 0:
            raise ValueError(f"batch_prompts must be > 0, got {self.batch_prompts}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    @property
    def counted(self) -> int:
        """Admissions that count against the bound."""
        return self.started - self.filtered

    def can_admit(self, version: int) -> bool:
        return self.counted // self.batch_prompts <= version + self.max_staleness

    def refund(self, n: int) -> None:
        """`n` admitted prompts were filtered out: their budget is free again."""
        if not 0 <= n <= self.counted:
            raise ValueError(f"refund of {n} prompts, only {self.counted} counted")
        self.filtered += n

    def admit(self, version: int) -> int:
        """Records one admission; returns the prompt's admission number (0-based group id)."""
        if not self.can_admit(version):
            raise RuntimeError(
                f"admission beyond the staleness bound (started={self.started}, version={version})"
            )
        self.started += 1
        return self.started - 1

    def ahead(self, version: int) -> int:
        """How many versions ahead of `version` admission has run (always <= max_staleness)."""
        return max(0, (self.counted - 1) // self.batch_prompts - version) if self.counted else 0


class RolloutQueue:
    """Completed prompt groups, handed to the trainer oldest start version first.

    Args:
      group_size: samples per prompt; a group is ready once all its samples are graded.
      max_head_staleness: optional hard cap (None = off): groups whose oldest head staleness exceeds it when
        popped are dropped and counted, with their completion lengths recorded (dropping biases training
        against long answers, so the lengths are reported).
    """

    def __init__(self, group_size: int, max_head_staleness: int | None = None):
        self.group_size = group_size
        self.max_head_staleness = max_head_staleness
        self._pending: dict[int, list[Rollout]] = {}
        self._ready: list[tuple[int, int, list[Rollout]]] = []
        self.dropped_groups = 0
        self.dropped_lengths: list[int] = []
        self.dropped_ids: list[int] = []  # group ids dropped since the caller last took them

    def add(self, rollout: Rollout) -> None:
        group = self._pending.setdefault(rollout.group_id, [])
        group.append(rollout)
        if len(group) == self.group_size:
            del self._pending[rollout.group_id]
            self.add_group(group)

    def add_group(self, group: list[Rollout]) -> None:
        """A whole graded group (all `group_size` samples of one prompt)."""
        if len(group) != self.group_size:
            raise ValueError(
                f"group {group[0].group_id} has {len(group)} samples, expected {self.group_size}"
            )
        group.sort(key=lambda r: r.sample_index)
        start = min(r.start_version for r in group)
        heapq.heappush(self._ready, (start, group[0].group_id, group))

    def ready_groups(self) -> int:
        return len(self._ready)

    def pending_samples(self) -> int:
        return sum(len(g) for g in self._pending.values())

    def pop_batch(self, num_groups: int, trainer_version: int) -> list[list[Rollout]] | None:
        """The `num_groups` oldest ready groups, or None if fewer are ready (after dropping over-cap ones)."""
        if self.max_head_staleness is not None:
            keep = []
            for item in self._ready:
                if trainer_version - item[0] > self.max_head_staleness:
                    self.dropped_groups += 1
                    self.dropped_ids.append(item[1])
                    self.dropped_lengths.extend(len(r.completion_tokens) for r in item[2])
                else:
                    keep.append(item)
            if len(keep) != len(self._ready):
                self._ready = keep
                heapq.heapify(self._ready)
        if len(self._ready) < num_groups:
            return None
        return [heapq.heappop(self._ready)[2] for _ in range(num_groups)]


def staleness_stats(groups: list[list[Rollout]], trainer_version: int) -> dict[str, Any]:
    """Head and per-token staleness of a train batch, and the fraction of its samples whose tokens came
    from more than one policy version (weights updated in flight; 0 with the "finish" update mode)."""
    rollouts = [r for g in groups for r in g]
    head = np.array([trainer_version - r.start_version for r in rollouts], np.int64)
    tok = np.concatenate(
        [trainer_version - r.model_versions.astype(np.int64) for r in rollouts if len(r.model_versions)]
        or [np.zeros(0, np.int64)]
    )
    return {
        "head_mean": float(head.mean()) if head.size else 0.0,
        "head_max": int(head.max()) if head.size else 0,
        "token_mean": float(tok.mean()) if tok.size else 0.0,
        "token_max": int(tok.max()) if tok.size else 0,
        "mixed_frac": float(np.mean([len(np.unique(r.versions)) > 1 for r in rollouts])) if rollouts else 0.0,
        "head_values": head,
        "token_values": tok,
    }


def uninformative(group: list[Rollout]) -> bool:
    """All rewards equal: group-relative advantages are 0, so the group carries no policy gradient."""
    rewards = [r.reward for r in group]
    return max(rewards) - min(rewards) <= 1e-8


@dataclasses.dataclass
class GroupFilter:
    """DAPO's dynamic sampling: discards uninformative groups as they arrive, and says when the data has
    no learning signal left (`patience_groups` discarded in a row).

    Attributes:
      enabled: filter at all (off: every group is kept and nothing is counted).
      patience_groups: discarded groups in a row after which `exhausted` is True.
    """

    enabled: bool
    patience_groups: int
    filtered_total: int = 0  # the run's discarded groups
    in_a_row: int = 0  # discarded since the last kept group
    _kept_since: int = 0  # kept / discarded since the last `step_values`
    _filtered_since: int = 0

    def split(self, groups: list[list[Rollout]]) -> tuple[list[list[Rollout]], list[int]]:
        """(the groups to train, the group ids discarded), in arrival order."""
        kept, filtered = [], []
        for g in groups:
            if self.enabled and uninformative(g):
                filtered.append(g[0].group_id)
                self.in_a_row += 1
            else:
                kept.append(g)
                self.in_a_row = 0
        self._kept_since += len(kept)
        self._filtered_since += len(filtered)
        self.filtered_total += len(filtered)
        return kept, filtered

    @property
    def exhausted(self) -> bool:
        return self.enabled and self.in_a_row >= self.patience_groups

    def step_values(self) -> dict[str, float]:
        """Yield (groups kept / groups finished since the last call) and the run's discarded total, as
        TensorBoard values (none when filtering is off); starts the next window."""
        if not self.enabled:
            return {}
        seen = self._kept_since + self._filtered_since
        values = {
            "dynamic_sampling/yield": self._kept_since / seen if seen else 1.0,
            "dynamic_sampling/filtered_groups": float(self.filtered_total),
        }
        self._kept_since = self._filtered_since = 0
        return values


# A step whose every update is non-finite changes no weight, and its groups are sampled again; this many
# such steps in a row end the run (saved at the last finite version): the weights or the data, not one
# batch, make the loss NaN/inf.
NON_FINITE_STEPS_IN_A_ROW = 3


@dataclasses.dataclass
class NonFiniteSteps:
    """Train steps whose every update had a non-finite loss or gradient (skipped: no weight changed, and
    their groups are sampled again), and whether enough came in a row to end the run.

    Attributes:
      limit: non-finite steps in a row after which `stop` is True.
    """

    limit: int = NON_FINITE_STEPS_IN_A_ROW
    total: int = 0  # the run's non-finite steps
    in_a_row: int = 0  # since the last step that changed the weights

    def record(self, finite: bool) -> None:
        """One finished train step: `finite` if at least one of its updates was applied."""
        if finite:
            self.in_a_row = 0
        else:
            self.total += 1
            self.in_a_row += 1

    @property
    def stop(self) -> bool:
        return self.in_a_row >= self.limit
