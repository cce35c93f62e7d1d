"""`python tools/bench_kernels.py ...`: see jaxrl_async/cli/bench_kernels.py."""

from jaxrl_async.cli.bench_kernels import run

if __name__ == "__main__":
    run()
