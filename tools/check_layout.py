"""`python tools/check_layout.py ...`: see jaxrl_async/cli/check_layout.py (the launchers run it first)."""

from jaxrl_async.cli.check_layout import run

if __name__ == "__main__":
    run()
