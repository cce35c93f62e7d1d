"""`python tools/bench_decode.py ...` = `jaxrl-bench-decode ...`: see jaxrl_async/cli/bench_decode.py."""

from jaxrl_async.cli.bench_decode import run

if __name__ == "__main__":
    run()
