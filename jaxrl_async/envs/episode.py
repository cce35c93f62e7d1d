"""A multi-turn episode as token-exact training data, and a reference driver that runs one.

An `Episode` holds the tokens after the prompt in order: model turns (each token with its behaviour
logprob and the policy version that sampled it) and observations (token ids the environment gave:
no logprob, no version). `to_rollout` turns it into a `Rollout` whose `model_mask` marks the model's
tokens; the trainer masks the others out of the loss, the advantage, the KL and every statistic.

`run_episode` is the plain reference loop (each turn samples from the whole context again): tests and
evaluation use it, and it defines what the sampler's continued slots must reproduce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl_async.envs.config import EnvConfig
from jaxrl_async.envs.env import Encoder, Environment, StepResult
from jaxrl_async.rollouts import OBSERVATION_VERSION, Rollout


@dataclasses.dataclass
class Episode:
    """One episode's tokens after the prompt, with what the trainer needs of each."""

    prompt_tokens: np.ndarray
    uid: Any = None
    sample_index: int = 0
    tokens: list = dataclasses.field(default_factory=list)
    model_mask: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    finish_reason: str = ""
    observation_cuts: int = 0  # observations cut to the per-step or episode bound

    @property
    def length(self) -> int:
        """Tokens after the prompt."""
        return len(self.tokens)

    def add_turn(self, tokens, logprobs, versions) -> None:
        tokens, logprobs, versions = list(tokens), list(logprobs), list(versions)
        if not len(tokens) == len(logprobs) == len(versions):
            raise ValueError(
                f"a turn of {len(tokens)} tokens with {len(logprobs)} logprobs, {len(versions)} versions"
            )
        self.tokens += [int(t) for t in tokens]
        self.model_mask += [True] * len(tokens)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [int(v) for v in versions]
        self.turns += 1

    def add_observation(self, tokens) -> None:
        tokens = [int(t) for t in tokens]
        self.tokens += tokens
        self.model_mask += [False] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.versions += [OBSERVATION_VERSION] * len(tokens)

    @property
    def observation_tokens(self) -> int:
        return len(self.model_mask) - sum(self.model_mask)

    def to_rollout(self, uid="", group_id: int = 0, sample_index: int = 0, metadata=None) -> Rollout:
        return Rollout(
            uid=uid,
            group_id=group_id,
            sample_index=sample_index,
            prompt_tokens=np.asarray(self.prompt_tokens, np.int32),
            completion_tokens=np.asarray(self.tokens, np.int32),
            behav_logprobs=np.asarray(self.logprobs, np.float32),
            versions=np.asarray(self.versions, np.int32),
            reward=float(self.reward),
            finish_reason=self.finish_reason,
            metadata=dict(metadata or {}) | {"turns": self.turns},
            model_mask=np.asarray(self.model_mask, bool),
        )


def observe(episode: Episode, result: StepResult, cfg: EnvConfig, encoder: Encoder) -> bool:
    """Applies an environment's answer to `episode` under the bounds every environment shares; returns
    whether the episode goes on.

    The observation (text is encoded; characters the tokenizer cannot encode become "?") is cut to
    `cfg.max_observation_tokens` and to the episode's remaining `cfg.max_episode_tokens`; the episode
    ends when the environment says so, at `cfg.max_turns` turns, or when no token is left for a turn.
    """
    episode.reward = float(result.reward)
    if result.done:
        episode.finish_reason = str(result.info.get("reason", "done"))
        return False
    obs = result.observation
    ids = encoder.encode(obs)[0] if isinstance(obs, str) else [int(t) for t in (obs or ())]
    room = min(cfg.max_observation_tokens, cfg.max_episode_tokens - episode.length)
    if len(ids) > room:
        ids = ids[: max(room, 0)]
        episode.observation_cuts += 1
    episode.add_observation(ids)
    if episode.turns >= cfg.max_turns:
        episode.finish_reason = "max_turns"
        return False
    if episode.length >= cfg.max_episode_tokens:
        episode.finish_reason = "max_episode_tokens"
        return False
    return True


# generate(context tokens, max_new_tokens) -> (tokens, logprobs, versions) of one model turn.
GenerateFn = Callable[[Sequence[int], int], tuple]


def run_episode(env: Environment, prompt_tokens, generate: GenerateFn, tokenizer, cfg: EnvConfig,
                max_turn_tokens: int) -> Episode:  # fmt: skip
    """Runs one episode: each turn samples from the whole context so far (at most `max_turn_tokens`
    tokens, and never past the episode's token bound)."""
    episode = Episode(np.asarray(prompt_tokens, np.int32))
    encoder = Encoder(tokenizer)
    while True:
        budget = min(max_turn_tokens, cfg.max_episode_tokens - episode.length)
        context = [*episode.prompt_tokens.tolist(), *episode.tokens]
        tokens, logprobs, versions = generate(context, budget)
        episode.add_turn(tokens[:budget], logprobs[:budget], versions[:budget])
        if not observe(episode, env.step(tokenizer.decode(tokens[:budget])), cfg, encoder):
            return episode
