"""`python tools/perf_model.py ...` = `jaxrl-perf ...`: see jaxrl_async/cli/perf_model.py."""

from jaxrl_async.cli.perf_model import run

if __name__ == "__main__":
    run()
