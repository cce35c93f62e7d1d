"""`python tools/bench_learning.py ...`: see jaxrl_async/cli/bench_learning.py."""

from jaxrl_async.cli.bench_learning import run

if __name__ == "__main__":
    run()
