"""Rewards: the registry of reward functions, the math verifier, the code sandbox and the worker pool.

Heavy modules (math-verify, the sandbox) load only when their reward is first used.
"""

from jaxrl_async.rewards.registry import Graded, as_graded, get_reward, list_rewards, register_reward
from jaxrl_async.rewards.service import QueueFull, RewardConfig, RewardResult, RewardService, grade_one

__all__ = [
    "Graded",
    "QueueFull",
    "RewardConfig",
    "RewardResult",
    "RewardService",
    "as_graded",
    "get_reward",
    "grade_one",
    "list_rewards",
    "register_reward",
]
