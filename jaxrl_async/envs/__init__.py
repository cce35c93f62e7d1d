"""Multi-turn episodes: the environment interface, tools and their formats, bounds, and episodes as
token-exact training data (docs/environments.md)."""

from jaxrl_async.envs.calls import FORMATS, Malformed, ToolCall, get_format
from jaxrl_async.envs.config import EnvConfig
from jaxrl_async.envs.env import (
    Encoder,
    EnvFactory,
    Environment,
    StepResult,
    ToolEnv,
    load_environment,
    make_env_factory,
    tool_env_factory,
)
from jaxrl_async.envs.episode import Episode, observe, run_episode
from jaxrl_async.envs.executor import ToolExecutor, ToolOutcome, ToolStats
from jaxrl_async.envs.tools import ToolError, calculator, get_tool, register_tool, registered_tools

__all__ = [
    "FORMATS",
    "Encoder",
    "EnvConfig",
    "EnvFactory",
    "Environment",
    "Episode",
    "Malformed",
    "StepResult",
    "ToolCall",
    "ToolEnv",
    "ToolError",
    "ToolExecutor",
    "ToolOutcome",
    "ToolStats",
    "calculator",
    "get_format",
    "get_tool",
    "load_environment",
    "make_env_factory",
    "observe",
    "register_tool",
    "registered_tools",
    "run_episode",
    "tool_env_factory",
]
