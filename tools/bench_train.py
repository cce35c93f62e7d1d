"""`python tools/bench_train.py ...` = `jaxrl-bench-train ...`: see jaxrl_async/cli/bench_train.py."""

from jaxrl_async.cli.bench_train import run

if __name__ == "__main__":
    run()
