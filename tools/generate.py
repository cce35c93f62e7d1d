"""`python tools/generate.py ...` = `jaxrl-generate ...`: see jaxrl_async/cli/generate.py."""

from jaxrl_async.cli.generate import run

if __name__ == "__main__":
    run()
