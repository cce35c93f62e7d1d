"""Multi-turn episodes in a run (config.env): what the actor and actor 0's evaluation run instead of
single-turn completions, kept out of the actor so that it stays an event loop.

`EpisodeRunner` turns each granted prompt into G episodes on the actor's sampler loop
(`envs.driver.EpisodeDriver`: a turn's slot parks while its environment answers on the driver's threads,
never on the actor's poll), and hands back each episode that ended with its prompt record. The actor
grades them (`rollout_groups.GroupAssembly.submit_episodes`): an episode that ended with an answer is
graded by the run's reward service on the answer turn's text, like a single-turn completion (a reward
that crashes or hangs scores 0 in the service's worker pool); any other ending keeps the environment's
own reward (0 for `ToolEnv`).

`EpisodeEvaluation` is `evaluation.Evaluation` with greedy episodes: held-out accuracy of whole episodes,
tools included.

Resume needs nothing of its own: an episode is one granted prompt's sample, so an episode in flight at a
checkpoint is a prompt the coordinator's ledger holds as granted and not trained, and a resumed run starts
it again, whole, once (tests/test_multiturn_run.py).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxrl_async.envs import EnvConfig, make_env_factory
from jaxrl_async.envs.driver import EpisodeDriver
from jaxrl_async.envs.metrics import add_tool_window
from jaxrl_async.run_config import ConfigError
from jaxrl_async.runtime.evaluation import Evaluation
from jaxrl_async.sampler import SamplerConfig, SamplerLoop
from jaxrl_async.sampler.kernel_choice import ACCELERATORS, target_platform


def episode_kernels(cfg: SamplerConfig, model_cfg, mesh, max_episode_tokens: int) -> SamplerConfig:
    """`cfg` with "auto" kernels pinned where they could resolve to a CPU kernel: appending an observation
    (`Engine.extend`) runs XLA ops on unpacked weights over the slotted or the paged cache (validation
    refuses an explicit 'cpu_kernel'). On an accelerator "auto" is the paged cache with XLA matmuls, whose
    slots hold max_prompt_len + max_new_tokens: the episode must fit that (ConfigError)."""
    on_accelerator = target_platform(model_cfg, mesh) in ACCELERATORS
    attention = cfg.attention if cfg.attention != "auto" or on_accelerator else "xla"
    linear = "xla" if cfg.linear == "auto" else cfg.linear
    if attention != "xla" and cfg.max_prompt_len + max_episode_tokens > cfg.max_seq_len:
        raise ConfigError(  # run_config checked the slotted cache's capacity; this one is paged
            f"config.env.max_episode_tokens={max_episode_tokens}: config.sampler.max_prompt_len="
            f"{cfg.max_prompt_len} + the episode's tokens exceed the paged cache's max_prompt_len + "
            f"max_new_tokens = {cfg.max_seq_len} (attention {cfg.attention!r}: the paged cache here)"
        )
    if (attention, linear) == (cfg.attention, cfg.linear):
        return cfg
    return dataclasses.replace(cfg, attention=attention, linear=linear)


def _graded_by_the_service(row, answer: str) -> float:
    """ToolEnv's reward_fn in a run: 0 here; the answer is graded by the reward service afterwards."""
    return 0.0


def answer_text(episode, tokenizer) -> str:
    """The episode's last model turn (the tokens after its last observation), as text."""
    mask = episode.model_mask
    start = len(mask)
    while start > 0 and mask[start - 1]:
        start -= 1
    return tokenizer.decode(episode.tokens[start:])


def episode_text(episode, tokenizer) -> str:
    """The whole episode as text, turns and observations decoded one segment at a time (a tokenizer may
    stop decoding at the stop token that ends each turn)."""
    out, start = [], 0
    mask = episode.model_mask
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append(tokenizer.decode(episode.tokens[start:i]))
            start = i
    return "".join(out)


def sample_round(loop: SamplerLoop, episodes: EpisodeRunner | None, groups) -> bool:
    """One decode call of an actor's sampling (its requests are queued), the finished samples handed to
    `groups` (GroupAssembly): single-turn completions (`loop.step()`), or episodes (`episodes.step()`).
    True if there was work (something finished, or the loop is not idle)."""
    if episodes is None:
        completions = loop.step()
        groups.submit(completions)
        return bool(completions) or not loop.idle
    finished = episodes.step()
    groups.submit_episodes(finished)
    return bool(finished) or not loop.idle


def sampling_idle(loop: SamplerLoop, episodes: EpisodeRunner | None) -> bool:
    """Nothing to decode and (episodes) no episode in flight: parked slots leave the loop idle."""
    return loop.idle and not (episodes is not None and episodes.in_flight)


def evaluation_for(env: EnvConfig, members=None):
    """What evaluates a version (`EvalSchedule`'s `evaluation`): greedy episodes with config.env, else
    single-turn completions. `members`: as for `EpisodeRunner`."""
    return functools.partial(EpisodeEvaluation, env, members=members) if env.enabled else Evaluation


def _driven_loop(loop: SamplerLoop, members, evaluation: bool):
    """The loop an episode driver steps: on a replica that spans processes, one whose calls the members
    make too (`replica.MirroredLoop`)."""
    if members is None:
        return loop
    from jaxrl_async.runtime.replica import MirroredLoop  # replica.py imports the sampler's run pieces

    return MirroredLoop(loop, members, evaluation)


class EpisodeRunner:
    """G episodes per granted prompt on one sampler loop (see the module docstring).

    Args:
      cfg: the run's EnvConfig.
      loop: the actor's SamplerLoop (the driver steps it; nothing else may).
      tokenizer: decodes turns, encodes observations.
      members: the leader's `replica.Members` of a replica that spans processes (they make the driver's
        queueing, resumes and finishes with it), or None.
      schedule: the actor's schedule recorder (`schedule_log.ActorSchedule`): each environment's answer,
        at the decode call it was applied after, is a decision of timing and of the outside world.
    """

    def __init__(self, cfg: EnvConfig, loop: SamplerLoop, tokenizer, members=None, schedule=None):
        self.cfg, self.loop = cfg, loop
        factory, self.executor = make_env_factory(cfg, tokenizer, _graded_by_the_service)
        driven = _driven_loop(loop, members, evaluation=False)
        self.driver = EpisodeDriver(driven, cfg, tokenizer, factory, workers=cfg.tool_workers,
                                    on_answer=None if schedule is None else schedule.answered)  # fmt: skip
        self._prompts: dict[int, list] = {}  # group id -> [its Prompt, episodes not yet ended]
        self._totals: dict = {"episodes": 0}  # running counters (`stats`)

    def add_request(self, request) -> None:
        """Starts a granted prompt's episodes (`request`: the ticket book's sampler Request; its metadata
        is the Prompt record, which is also each environment's row)."""
        prompt = request.metadata
        self._prompts[int(request.uid)] = [prompt, request.n_samples]
        self.driver.add(request.uid, prompt, request.prompt_tokens, request.n_samples, request.seed)

    def step(self) -> list:
        """One decode call of the loop (the driver's); [(Episode, Prompt)] of the episodes that ended."""
        out = []
        for episode in self.driver.step():
            entry = self._prompts[int(episode.uid)]
            entry[1] -= 1
            if not entry[1]:
                del self._prompts[int(episode.uid)]
            out.append((episode, entry[0]))
        self._totals["episodes"] += len(out)
        return out

    @property
    def in_flight(self) -> int:
        return self.driver.in_flight

    @property
    def waiting(self) -> bool:
        """Environments are answering (the loop may have nothing to decode meanwhile)."""
        return self.driver.waiting

    def wait(self, timeout_s: float) -> None:
        self.driver.wait(timeout_s)

    def stats(self) -> dict:
        """Running counters since the start (`envs.metrics.tool_values` reads them on the learner)."""
        self._totals = add_tool_window(self._totals, self.executor.stats.take())
        return self._totals | {
            "env_errors": self.driver.env_errors,
            # a gauge, like the executor's: tool calls and environment steps still running past deadline
            "tool_threads_abandoned": self._totals.get("tool_threads_abandoned", 0) + self.driver.stuck,
            "parked_slot_fraction": float(self.loop.stats.parked_fraction),
        }

    def close(self) -> None:
        self.driver.close()
        self.executor.close()


class EpisodeEvaluation(Evaluation):
    """Greedy held-out episodes of one version (`Evaluation`'s interface): one prompt, one episode; an
    episode that ends with an answer is graded by the reward service, any other ending counts as wrong
    at once.

    Args:
      env: the run's EnvConfig; the rest as for `Evaluation`.
      members: as for `EpisodeRunner` (the members also make each of this evaluation's loop steps).
    """

    def __init__(self, env: EnvConfig, engine, rewards, tokenizer, prompts, params, version: int,
                 members=None):  # fmt: skip
        super().__init__(engine, rewards, tokenizer, [], params, version)
        self.total = len(prompts)
        self.weights = {p.uid: float(p.weight) for p in prompts}
        self.total_weight = sum(self.weights.values())
        # The evaluation's own tool threads and counters: held-out tool calls are not the run's env/ tags.
        factory, self.executor = make_env_factory(env, tokenizer, _graded_by_the_service)
        driven = _driven_loop(self.loop, members, evaluation=True)
        self.driver = EpisodeDriver(driven, env, tokenizer, factory, workers=env.tool_workers)
        self._prompts = {}
        for i, p in enumerate(prompts):
            self._prompts[i] = p
            self.driver.add(i, p, tuple(int(t) for t in p.tokens))

    def step(self) -> None:
        for episode in self.decode():
            p = self._prompts.pop(int(episode.uid))
            key = ("eval", self.version, p.uid)
            if episode.finish_reason == "answer":
                text = answer_text(episode, self.tokenizer)
                self.rewards.submit(key, p.text, text, dict(p.metadata))
            else:
                self.take(key, 0.0)

    def decode(self) -> list:
        if not self.driver.in_flight:
            return []
        self.calls += 1
        finished = self.driver.step()
        if not finished and self.loop.idle and self.driver.waiting:
            # Only held-out tools are working: the actor's poll counts a running evaluation as busy and
            # would spin; a short wait (a calculator answers in microseconds) keeps it from that.
            self.driver.wait(0.002)
        return finished

    def close(self) -> None:
        self.driver.close()
        self.executor.close()


def episode_sample_tokens(episode) -> int:
    """Tokens the model sampled in an episode (its observations left out)."""
    return int(np.sum(episode.model_mask))


def grade_greedy_episodes(env: EnvConfig, engine, rewards, tokenizer, prompts, sampler_params, version=None):
    """[(prompt, reward)] of every prompt's greedy episode, all at once (blocking: the supervised warm
    start's check, `build._WarmStartEval`, where `evaluation.grade_greedy` would grade a tool call as the
    answer). Graded as `EpisodeEvaluation` grades: an answer by the reward service, any other ending 0."""
    if sampler_params is not None:
        engine.update_params(sampler_params, version)
    factory, executor = make_env_factory(env, tokenizer, _graded_by_the_service)
    driver = EpisodeDriver(SamplerLoop(engine), env, tokenizer, factory, workers=env.tool_workers)
    try:
        for i, p in enumerate(prompts):
            driver.add(i, p, tuple(int(t) for t in p.tokens))
        episodes = driver.run()
    finally:
        driver.close()
        executor.close()
    answered = [e for e in episodes if e.finish_reason == "answer"]
    items = [(prompts[int(e.uid)].text, answer_text(e, tokenizer), dict(prompts[int(e.uid)].metadata))
             for e in answered]  # fmt: skip
    graded = dict(zip((int(e.uid) for e in answered), rewards.grade_batch(items), strict=True))
    return [(prompts[int(e.uid)], graded.get(int(e.uid), 0.0)) for e in episodes]
