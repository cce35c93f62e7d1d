"""`python tools/bench_rewards.py ...` = `jaxrl-bench-rewards ...`: see jaxrl_async/cli/bench_rewards.py."""

from jaxrl_async.cli.bench_rewards import run

if __name__ == "__main__":
    run()
