"""`python tools/bench_transport.py ...`: see jaxrl_async/cli/bench_transport.py."""

from jaxrl_async.cli.bench_transport import run

if __name__ == "__main__":
    run()
