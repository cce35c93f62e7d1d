"""`python tools/evaluate.py ...`: see jaxrl_async/cli/evaluate.py."""

from jaxrl_async.cli.evaluate import run

if __name__ == "__main__":
    run()
