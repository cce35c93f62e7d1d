"""`python tools/bench_checkpoint.py ...`: see jaxrl_async/cli/bench_checkpoint.py."""

from jaxrl_async.cli.bench_checkpoint import run

if __name__ == "__main__":
    run()
