"""Environments the multi-turn run tests name in config.env.environment ("multiturn_envs:first_turn_calls",
importable because tests/ is on the path of the test process and of the runs it starts).

A random tiny model never writes a tool call by itself, so `FirstTurnCalls` takes every episode's first turn
as a calculator call on the prompt's sum, whatever the model wrote: each episode then has an observation
(the tool's real answer, through the run's executor and its counters) and a second turn of the model's own.
"""

import random
import time

from jaxrl_async.envs import ToolEnv, register_tool
from jaxrl_async.envs.tools import calculator


@register_tool("slow_calculator")
def slow_calculator(expression: str) -> str:
    """The calculator, 50 ms late: keeps episodes in flight (parked) long enough for a kill to catch some."""
    time.sleep(0.05)
    return calculator(expression)


class FirstTurnCalls(ToolEnv):
    """ToolEnv whose first turn calls the config's first tool on the prompt ("12+34=" -> "12+34")."""

    def step(self, turn: str):
        if self.turns == 0:
            turn = f"<tool name={self.cfg.tools[0]}>{self.row.text.rstrip('=')}</tool>"
        return super().step(turn)


def first_turn_calls(cfg, tokenizer, executor):
    return lambda row: FirstTurnCalls(row, cfg, tokenizer, executor, lambda row, answer: 0.0)


@register_tool("jittery_calculator")
def jittery_calculator(expression: str) -> str:
    """The calculator, nondeterministic as tools in the wild are: it answers after a random 0 to 20 ms (so
    its answer lands at a decode call that timing picks) and appends a random digit (its answer differs
    from run to run). A replay must follow the record, not the tool."""
    rng = random.SystemRandom()
    time.sleep(rng.uniform(0.0, 0.02))
    return f"{calculator(expression)}{rng.randrange(10)}"
