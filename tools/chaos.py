"""`python tools/chaos.py ...`: see jaxrl_async/cli/chaos.py."""

from jaxrl_async.cli.chaos import run

if __name__ == "__main__":
    run()
