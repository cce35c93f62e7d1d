"""The calculator environment with an injected latency per tool call, for benchmarks/bench_tool_runs.py.

A run names it as its user environment, `config.env.environment = "benchmarks.tool_latency_env:slow_calls"`
(`envs.env.make_env_factory`): every episode is configs/calc_tool.py's `ToolEnv`, except that each tool call
the environment runs first waits `JAXRL_BENCH_TOOL_LATENCY_MS` milliseconds (a sleep, as a remote tool's
round trip would), on the episode driver's thread, while the episode's slot stays parked. The latency comes
from the process environment, not from the config: it is a benchmark's fixture, not a product setting.

No absl flags here: the run process imports this module.
"""

from __future__ import annotations

import os
import threading
import time

from jaxrl_async.envs import ToolEnv

LATENCY_VAR = "JAXRL_BENCH_TOOL_LATENCY_MS"


class SlowExecutor:
    """A `ToolExecutor` whose every call first sleeps `latency_s`; counts the calls it delayed."""

    def __init__(self, executor, latency_s: float):
        self.executor, self.latency_s = executor, latency_s
        self.delayed = 0
        self._lock = threading.Lock()  # calls come from the driver's threads

    @property
    def stats(self):
        return self.executor.stats

    def run(self, call):
        time.sleep(self.latency_s)
        with self._lock:
            self.delayed += 1
        return self.executor.run(call)


def latency_s() -> float:
    """The injected latency in seconds. Raises ValueError when the variable is unset or not a number >= 0
    (a benchmark that forgot it would measure no latency and say it did)."""
    raw = os.environ.get(LATENCY_VAR)
    try:
        ms = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{LATENCY_VAR} must hold the latency per tool call in ms, got {raw!r}") from None
    if ms < 0:
        raise ValueError(f"{LATENCY_VAR} must be >= 0, got {raw!r}")
    return ms / 1000


def slow_calls(cfg, tokenizer, executor):
    """The environment maker (`EnvConfig.environment`): ToolEnv over the run's executor, slowed. Its reward
    function is never the grade: the run grades an answered episode with its reward service."""
    slow = SlowExecutor(executor, latency_s())
    return lambda row: ToolEnv(row, cfg, tokenizer, slow, lambda row, answer: 0.0)
