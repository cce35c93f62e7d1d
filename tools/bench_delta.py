"""`python tools/bench_delta.py ...`: see jaxrl_async/cli/bench_delta.py."""

from jaxrl_async.cli.bench_delta import run

if __name__ == "__main__":
    run()
