"""`python tools/window_check.py ...`: see jaxrl_async/cli/window_check.py."""

from jaxrl_async.cli.window_check import run

if __name__ == "__main__":
    run()
