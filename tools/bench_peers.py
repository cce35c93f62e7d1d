"""`python tools/bench_peers.py ...`: see jaxrl_async/cli/bench_peers.py."""

from jaxrl_async.cli.bench_peers import run

if __name__ == "__main__":
    run()
