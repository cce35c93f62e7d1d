"""EnvConfig: the bounds and policies of multi-turn episodes, validated on construction.

A run's `config.env` section becomes one of these (the run validates it before anything compiles); every
error names the field as `config.env.<field>`.
"""

from __future__ import annotations

import dataclasses

TOOL_FORMATS = ("tags", "json")
ERROR_POLICIES = ("observe", "end")


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Multi-turn episode settings.

    Attributes:
      enabled: a run (config.env) runs multi-turn episodes: each granted prompt's G samples are episodes
        on the sampler, parked while their environment answers. False = single-turn completions, and
        every other field must keep its default (a run refuses settings it would not read). The library
        pieces (driver, ToolEnv) do not read it.
      environment: "" = `ToolEnv` over `tools`; else "package.module:function" naming a factory
        `function(cfg, tokenizer, executor) -> (row -> environment)` (`env.make_env_factory`): the run
        imports it on the actor's host, `executor` is the run's `ToolExecutor` over `tools`.
      tools: names of the registered tools the model may call (`tools.get_tool`); () = no tools.
      tool_format: how a turn calls a tool and how the answer comes back (`calls.FORMATS`): "tags"
        (`<tool name=NAME>ARGS</tool>`, answered `<result>TEXT</result>`) or "json"
        (`<tool>{"name": NAME, "arguments": ARGS}</tool>`, answered the same way).
      max_turns: model turns per episode (the episode ends after this many, answered or not).
      max_tool_calls: tool calls per episode; a call past it is answered with an error observation.
      max_observation_tokens: tokens of one observation (a tool's output is cut to fit, its result
        markers kept).
      max_episode_tokens: tokens after the prompt (model turns and observations together); the episode
        ends when they run out.
      tool_timeout_s: wall-clock limit of one tool call; past it the call is answered with a time-out
        error (the tool's thread is abandoned; sandboxed tools are killed by their own limits).
      tool_workers: threads that run tool calls (off the decode loop).
      step_timeout_s: wall-clock limit of one environment answer (its `step`, and for the first answer
        also the making of the environment), from the end of the turn it answers; past it the episode
        ends as `env_timeout` with reward 0 (counted in the driver's env errors, its thread abandoned).
        Bounds a user environment that hangs itself (grades with a slow service, loops); it must exceed
        tool_timeout_s, since a `ToolEnv` step runs one tool call, whose own time-out is an observation.
      on_tool_error: "observe" (the error is the observation and the episode goes on) or "end" (the
        episode ends with reward 0 at the first tool error).
    """

    enabled: bool = False
    environment: str = ""
    tools: tuple[str, ...] = ()
    tool_format: str = "tags"
    max_turns: int = 4
    max_tool_calls: int = 3
    max_observation_tokens: int = 64
    max_episode_tokens: int = 512
    tool_timeout_s: float = 5.0
    tool_workers: int = 4
    step_timeout_s: float = 60.0
    on_tool_error: str = "observe"

    def __post_init__(self):
        object.__setattr__(self, "tools", tuple(self.tools))
        if self.tool_format not in TOOL_FORMATS:
            raise ValueError(f"config.env.tool_format={self.tool_format!r} not in {TOOL_FORMATS}")
        if self.on_tool_error not in ERROR_POLICIES:
            raise ValueError(f"config.env.on_tool_error={self.on_tool_error!r} not in {ERROR_POLICIES}")
        for name in ("max_turns", "max_observation_tokens", "max_episode_tokens", "tool_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.env.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.max_tool_calls, int) or self.max_tool_calls < 0:
            raise ValueError(
                f"config.env.max_tool_calls must be an integer >= 0, got {self.max_tool_calls!r}"
            )
        if not self.tool_timeout_s > 0:
            raise ValueError(f"config.env.tool_timeout_s must be > 0, got {self.tool_timeout_s!r}")
        if not self.step_timeout_s > self.tool_timeout_s or self.step_timeout_s == float("inf"):
            raise ValueError(
                f"config.env.step_timeout_s={self.step_timeout_s!r} must be finite and exceed "
                f"config.env.tool_timeout_s={self.tool_timeout_s!r} (a step runs a tool call, whose own "
                "time-out is an error observation, not the episode's end)"
            )
        if not isinstance(self.enabled, bool):
            raise ValueError(f"config.env.enabled must be True or False, got {self.enabled!r}")
        if not isinstance(self.environment, str) or (self.environment and ":" not in self.environment):
            got = self.environment
            raise ValueError(f'config.env.environment must be "" or "package.module:function", got {got!r}')
        if len(set(self.tools)) != len(self.tools):
            raise ValueError(f"config.env.tools lists a tool twice: {self.tools}")
        if self.max_observation_tokens > self.max_episode_tokens:
            raise ValueError(
                f"config.env.max_observation_tokens={self.max_observation_tokens} exceeds "
                f"config.env.max_episode_tokens={self.max_episode_tokens}"
            )
