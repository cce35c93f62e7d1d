"""`python tools/bench_async.py ...` = `jaxrl-bench-async ...`: see jaxrl_async/cli/bench_async.py."""

from jaxrl_async.cli.bench_async import run

if __name__ == "__main__":
    run()
