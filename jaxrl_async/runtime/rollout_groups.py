"""An actor's rollout groups in assembly: completions out for grading, groups with some samples graded,
and finished groups (every one of the G samples graded) waiting to go to the learner.

Multi-turn runs submit finished episodes instead (`submit_episodes`): one that ended with an answer is
graded on its answer turn's text by the same reward service; any other ending keeps the environment's
reward (0 for tool episodes) without grading. Either way the sample becomes a Rollout with `model_mask`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl_async.rewards import RewardConfig
from jaxrl_async.rewards.shaping import overlong_penalty
from jaxrl_async.rollouts import Rollout
from jaxrl_async.runtime.episodes import answer_text, episode_text


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

    def submit_episodes(self, finished) -> None:
        """Finished episodes, [(Episode, Prompt)]: answers go to the reward service, other endings are
        final as they are."""
        for episode, prompt in finished:
            self.sample_tokens += int(sum(episode.model_mask))
            key = (int(episode.uid), int(episode.sample_index))
            if episode.finish_reason == "answer":
                self.pending[key] = (episode, prompt)
                text = answer_text(episode, self.tokenizer)
                self.rewards.submit(key, prompt.text, text, dict(prompt.metadata))
            else:
                self._complete(self._episode_rollout(episode, prompt, episode.reward, episode.finish_reason))

    def _episode_rollout(self, episode, prompt, reward: float, reason: str) -> Rollout:
        episode.reward = float(reward)
        meta = {"text": episode_text(episode, self.tokenizer), "prompt": prompt.text, "reason": reason,
                "overlong_penalty": 0.0}  # fmt: skip
        return episode.to_rollout(prompt.uid, int(episode.uid), int(episode.sample_index), meta)

    def add(self, result) -> None:
        """One reward result of a submitted completion; its group is ready once all G are graded."""
        c = self.pending.pop(result.request_id)
        if isinstance(c, tuple):  # an episode's answer
            self._complete(self._episode_rollout(*c, result.reward, result.reason))
            return
        rw, cap = self.reward, self.max_new_tokens
        shaping = overlong_penalty(len(c.tokens), cap, rw.overlong_buffer, rw.overlong_penalty)
        self._complete(to_rollout(c, result.reward, result.reason, self.tokenizer, shaping))

    def _complete(self, rollout: Rollout) -> None:
        group = self.partial.setdefault(rollout.group_id, [])
        group.append(rollout)
        if len(group) == self.samples:
            del self.partial[rollout.group_id]
            group.sort(key=lambda r: r.sample_index)
            self.ready.append(group)

    def take_ready(self) -> list[list[Rollout]]:
        """The finished groups (counted as sent)."""
        ready, self.ready = self.ready, []
        self.groups_sent += len(ready)
        return ready
