"""The environment interface of multi-turn episodes, and `ToolEnv`, the environment of tool calls.

An episode starts from a data row (its prompt is the row's, tokenized as in single-turn runs); the model
produces a turn; the environment answers with a `StepResult`: an observation (text, or token ids), the
reward so far and whether the episode is over. A user's environment is any object with
`step(turn_text) -> StepResult`, made per episode by a factory `row -> environment`:

    class Guess:                                    # the model guesses a number; the env says higher/lower
        def __init__(self, row):
            self.target = int(row.answer)
        def step(self, turn):
            guess = int(turn.strip() or 0)
            if guess == self.target:
                return StepResult(None, reward=1.0, done=True)
            return StepResult("higher" if guess < self.target else "lower", reward=0.0, done=False)

The episode driver (`episode.py`) applies the bounds every environment shares (turns, observation
tokens per step, episode tokens); `ToolEnv` adds tool calls and their limits.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from jaxrl_async.envs.calls import Malformed, ToolCall, get_format
from jaxrl_async.envs.config import EnvConfig
from jaxrl_async.envs.executor import MAX_MESSAGE_CHARS, ToolExecutor, ToolStats


@dataclasses.dataclass(frozen=True)
class StepResult:
    """The environment's answer to one model turn.

    Attributes:
      observation: text or token ids appended to the context before the next turn (None or empty: none).
      reward: the episode's reward so far (the last one is the episode's reward).
      done: the episode is over.
      info: anything to log; `ToolEnv` sets "reason" (why it ended), "tool" and "error".
    """

    observation: str | Sequence[int] | None
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Environment(Protocol):
    """One episode's environment (a new one per episode)."""

    def step(self, turn: str) -> StepResult: ...


EnvFactory = Callable[[Any], Environment]


class Encoder:
    """Text -> token ids that never raises: characters the tokenizer cannot encode become "?" (or are
    dropped when "?" cannot be encoded either); counts what it replaced."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._ok: dict[str, bool] = {}

    def _encodable(self, ch: str) -> bool:
        if ch not in self._ok:
            try:
                self._ok[ch] = bool(self.tokenizer.encode(ch))
            except Exception:  # a tokenizer's refusal of a character is not the episode's failure
                self._ok[ch] = False
        return self._ok[ch]

    def encode(self, text: str) -> tuple[list[int], bool]:
        """(token ids, whether any character was replaced)."""
        try:
            return list(self.tokenizer.encode(text)), False
        except Exception:
            fallback = "?" if self._encodable("?") else ""
            kept = "".join(c if self._encodable(c) else fallback for c in text)
            return list(self.tokenizer.encode(kept)), True


class ToolEnv:
    """An episode in which the model may call tools before it answers.

    Each turn is parsed with the config's tool-call format: a turn without a call is the answer (graded
    by `reward_fn(row, answer_text)`, the episode ends); a call is run by the executor and its output,
    wrapped in the format's result markers and cut to `cfg.max_observation_tokens` tokens (the markers
    always survive), is the observation. A malformed call, an unknown tool, a call past
    `cfg.max_tool_calls` and a tool's failure are error observations, counted in the executor's stats;
    with `cfg.on_tool_error="end"` they end the episode with reward 0. A call in the last allowed turn
    (`cfg.max_turns`) is not run: the episode ends unanswered, reward 0.
    """

    def __init__(self, row, cfg: EnvConfig, tokenizer, executor: ToolExecutor, reward_fn: Callable):
        self.row, self.cfg, self.executor, self.reward_fn = row, cfg, executor, reward_fn
        self.format = get_format(cfg.tool_format)
        self.encoder = Encoder(tokenizer)
        self.turns = 0
        self.tool_calls = 0
        self.errors = 0

    @property
    def stats(self) -> ToolStats:
        return self.executor.stats

    def step(self, turn: str) -> StepResult:
        self.turns += 1
        call = self.format.parse(turn)
        if call is None:
            return StepResult(None, float(self.reward_fn(self.row, turn)), True, {"reason": "answer"})
        if self.turns >= self.cfg.max_turns:
            return StepResult(None, 0.0, True, {"reason": "max_turns"})
        if isinstance(call, Malformed):
            return self._error("malformed", f"malformed tool call: {call.reason}")
        if self.tool_calls >= self.cfg.max_tool_calls:
            return self._error(
                "call_limit", f"tool call limit ({self.cfg.max_tool_calls}) reached: answer now"
            )
        self.tool_calls += 1
        outcome = self.executor.run(call)
        info = {"reason": "tool", "tool": call.name, "error": outcome.error, "latency_s": outcome.latency_s}
        if outcome.error is None:
            observation, cut = self._observation(outcome.text)
            if not cut:
                return StepResult(observation, 0.0, False, info)
            self.stats.count_error("flood")  # within the character cut, over the token bound
            outcome = dataclasses.replace(outcome, error="flood")
            info["error"] = "flood"
        self.errors += 1
        if self.cfg.on_tool_error == "end":
            return StepResult(None, 0.0, True, info | {"reason": "tool_error"})
        message = f"output over the limit, cut: {outcome.text}" if outcome.error == "flood" else outcome.text
        return StepResult(self._observation(f"error: {message}")[0], 0.0, False, info)

    def _error(self, kind: str, message: str) -> StepResult:
        self.errors += 1
        self.stats.count_error(kind)
        info = {"reason": kind, "error": kind}
        if self.cfg.on_tool_error == "end":
            return StepResult(None, 0.0, True, info)
        return StepResult(self._observation(f"error: {message[:MAX_MESSAGE_CHARS]}")[0], 0.0, False, info)

    def _observation(self, body: str) -> tuple[list[int], bool]:
        """`<result>body</result>` as token ids, the body cut so that the whole fits the observation bound;
        markers in the body are neutralized (a tool cannot close its result or forge a call). Also says
        whether the body was cut."""
        body, neutralized = self.format.neutralize(body)
        head, _ = self.encoder.encode(self.format.result_open)
        tail, _ = self.encoder.encode(self.format.result_close)
        ids, replaced = self.encoder.encode(body)
        if neutralized or replaced:
            self.stats.count_cleaned()
        room = max(0, self.cfg.max_observation_tokens - len(head) - len(tail))
        return head + ids[:room] + tail, len(ids) > room


def tool_env_factory(cfg: EnvConfig, tokenizer, reward_fn: Callable, stats: ToolStats | None = None):
    """(factory row -> ToolEnv, the shared executor): one thread pool serves every episode's calls; a
    tool's output is cut to 16 characters per observation token before it is tokenized (no tokenizer
    makes a token of more than 16 characters of ordinary text, so the token cut decides)."""
    executor = ToolExecutor(cfg.tools, cfg.tool_timeout_s, cfg.tool_workers, 16 * cfg.max_observation_tokens,
                            stats)  # fmt: skip
    return (lambda row: ToolEnv(row, cfg, tokenizer, executor, reward_fn)), executor


def load_environment(spec: str) -> Callable:
    """The factory maker "package.module:function" names (`EnvConfig.environment`).

    Raises:
      ValueError: the module cannot be imported or has no such callable (the message names both).
    """
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"config.env.environment={spec!r}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"config.env.environment={spec!r}: {module_name!r} has no callable {attr!r}")
    return fn


def make_env_factory(cfg: EnvConfig, tokenizer, reward_fn: Callable, stats: ToolStats | None = None):
    """(factory row -> environment, the shared executor) for `cfg`: `tool_env_factory`'s ToolEnv, or the
    user's environment (`cfg.environment`), whose maker gets the executor so that its tool calls are
    bounded and counted like ToolEnv's."""
    factory, executor = tool_env_factory(cfg, tokenizer, reward_fn, stats)
    if cfg.environment:
        factory = load_environment(cfg.environment)(cfg, tokenizer, executor)
    return factory, executor


__all__ = ["Encoder", "EnvFactory", "Environment", "StepResult", "ToolCall", "ToolEnv", "load_environment",
           "make_env_factory", "tool_env_factory"]  # fmt: skip
