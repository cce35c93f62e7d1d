"""`python tools/bench_replica.py ...`: see jaxrl_async/cli/bench_replica.py."""

from jaxrl_async.cli.bench_replica import run

if __name__ == "__main__":
    run()
