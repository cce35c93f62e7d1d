"""`python tools/split_sweep.py ...`: see jaxrl_async/cli/split_sweep.py."""

from jaxrl_async.cli.split_sweep import run

if __name__ == "__main__":
    run()
