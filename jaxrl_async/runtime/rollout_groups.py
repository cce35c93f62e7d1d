"""An actor's rollout groups in assembly: completions out for grading, groups with some samples graded,
and finished groups (every one of the G samples graded) waiting to go to the learner.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl_async.rewards import RewardConfig
from jaxrl_async.rewards.shaping import overlong_penalty
from jaxrl_async.rollouts import Rollout


def to_rollout(c, reward: float, reason: str, tokenizer, shaping: float = 0.0) -> Rollout:
    """A graded sampler Completion (its metadata is the Prompt) as a trainer Rollout; `shaping` (the
    overlong term) is added to the verifier's reward and kept in the metadata."""
    return Rollout(
        uid=c.metadata.uid,
        group_id=int(c.uid),
        sample_index=int(c.sample_index),
        prompt_tokens=np.asarray(c.prompt_tokens, np.int32),
        completion_tokens=np.asarray(c.tokens, np.int32),
        behav_logprobs=np.asarray(c.logprobs, np.float32),
        versions=np.asarray(c.versions, np.int32),
        reward=float(reward) + shaping,
        finish_reason=c.finish_reason,
        metadata={
            "text": tokenizer.decode(c.tokens),
            "prompt": c.metadata.text,
            "reason": reason,
            "overlong_penalty": shaping,
        },  # fmt: skip
    )


class GroupAssembly:
    """Completions to rollout groups (see the module docstring).

    Args:
      samples_per_prompt: G, the samples of one group.
      reward: the run's RewardConfig (the overlong shaping added to each reward).
      max_new_tokens: the sampler's generation cap (where the overlong buffer ends).
      rewards: the reward service (its worker processes grade while the actor decodes).
      tokenizer: decodes completions for grading and the rollouts' text.
    """

    def __init__(self, samples_per_prompt: int, reward: RewardConfig, max_new_tokens: int, rewards,
                 tokenizer):  # fmt: skip
        self.samples, self.reward, self.max_new_tokens = samples_per_prompt, reward, max_new_tokens
        self.rewards, self.tokenizer = rewards, tokenizer
        self.pending: dict[tuple[int, int], Any] = {}  # reward request -> Completion
        self.partial: dict[int, list[Rollout]] = {}  # group id -> its graded samples so far
        self.ready: list[list[Rollout]] = []  # finished groups, not yet sent
        self.sample_tokens = 0  # completion tokens submitted for grading
        self.groups_sent = 0  # for the stall warning: where groups stop

    def submit(self, completions) -> None:
        """Sends finished completions to the reward service."""
        for c in completions:
            self.sample_tokens += len(c.tokens)
            key = (int(c.uid), int(c.sample_index))
            self.pending[key] = c
            prompt = c.metadata
            self.rewards.submit(key, prompt.text, self.tokenizer.decode(c.tokens), dict(prompt.metadata))

    def add(self, result) -> None:
        """One reward result of a submitted completion; its group is ready once all G are graded."""
        c = self.pending.pop(result.request_id)
        group = self.partial.setdefault(int(c.uid), [])
        rw, cap = self.reward, self.max_new_tokens
        shaping = overlong_penalty(len(c.tokens), cap, rw.overlong_buffer, rw.overlong_penalty)
        group.append(to_rollout(c, result.reward, result.reason, self.tokenizer, shaping))
        if len(group) == self.samples:
            del self.partial[int(c.uid)]
            group.sort(key=lambda r: r.sample_index)
            self.ready.append(group)

    def take_ready(self) -> list[list[Rollout]]:
        """The finished groups (counted as sent)."""
        ready, self.ready = self.ready, []
        self.groups_sent += len(ready)
        return ready
