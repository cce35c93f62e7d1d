"""Reward registry: `(prompt, completion, metadata) -> float` functions looked up by name or import path."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Graded:
    """A reward with a short human-readable note (why the code failed, what the parser saw)."""

    reward: float
    info: str = ""


RewardFn = Callable[[str, str, Mapping[str, Any]], "float | Graded"]

_REGISTRY: dict[str, RewardFn] = {}
# Built-ins live in modules that register them when imported; importing lazily keeps e.g. math-verify
# out of processes that never grade math.
_BUILTIN_MODULES = {
    "arithmetic": "jaxrl_async.rewards.synthetic",
    "countdown": "jaxrl_async.rewards.synthetic",
    "shift": "jaxrl_async.rewards.synthetic",
    "letter_range": "jaxrl_async.rewards.synthetic",
    "calc_tool": "jaxrl_async.rewards.synthetic",
    "math": "jaxrl_async.rewards.math",
    "format": "jaxrl_async.rewards.math",
    "code": "jaxrl_async.rewards.code",
}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: registers `fn` under `name` (workers must import the defining module, see RewardConfig)."""
    if not name or ":" in name:
        raise ValueError(f"register_reward: invalid name {name!r} (':' is reserved for import paths)")

    def deco(fn: RewardFn) -> RewardFn:
        old = _REGISTRY.get(name)
        if old is not None and getattr(old, "__qualname__", None) != getattr(fn, "__qualname__", None):
            raise ValueError(f"register_reward: {name!r} is already registered to {old!r}")
        _REGISTRY[name] = fn
        return fn

    return deco


def get_reward(name: str) -> RewardFn:
    """Returns the reward called `name`: a registered/built-in name, or an import path "pkg.module:fn".

    Raises:
      KeyError: unknown name (the message lists the known ones).
      ImportError / AttributeError: a bad import path.
    """
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
        return _REGISTRY[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        fn = getattr(importlib.import_module(module), attr)
        if not callable(fn):
            raise TypeError(f"get_reward: {name!r} is not callable")
        return fn
    raise KeyError(_unknown(name))


def check_reward_name(name: str) -> None:
    """Raises KeyError unless `name` is registered, built in, or an import path "pkg.module:fn" (whose
    module is not imported here); imports nothing."""
    module, colon, attr = name.partition(":")
    if colon:
        if not module or not attr:
            raise KeyError(f"reward {name!r}: an import path is 'pkg.module:fn'")
    elif name not in _REGISTRY and name not in _BUILTIN_MODULES:
        raise KeyError(_unknown(name))


def is_builtin(name: str) -> bool:
    """Whether `name` is one of the package's own rewards (loaded on first use)."""
    return name in _BUILTIN_MODULES


def list_rewards() -> list[str]:
    """Names available without an import path."""
    return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))


def _unknown(name: str) -> str:
    return f"unknown reward {name!r}; known: {list_rewards()}, or use an import path 'pkg.module:fn'"


def as_graded(out: Any) -> Graded:
    """Normalises a reward function's return value; raises TypeError/ValueError on anything but a finite
    number or a Graded."""
    if isinstance(out, Graded):
        value, info = out.reward, out.info
    elif isinstance(out, bool | int | float) or hasattr(out, "__float__"):
        value, info = out, ""
    else:
        raise TypeError(f"reward function returned {type(out).__name__}, expected float or Graded")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"reward function returned a non-finite value {value}")
    return Graded(value, info)
