"""`python tools/bench_sync_one_process.py ...`: see jaxrl_async/cli/bench_sync_one_process.py."""

from jaxrl_async.cli.bench_sync_one_process import run

if __name__ == "__main__":
    run()
