"""Fixtures shared by the tests and `benchmarks/bench_rewards.py`: hostile programs the sandbox must contain
(`hostile.py`) and reward hacks that must score 0 (`reward_hacks.py`). No grader imports them."""
