"""`python tools/bench_roles.py ...` = `jaxrl-bench-roles ...`: see jaxrl_async/cli/bench_roles.py."""

from jaxrl_async.cli.bench_roles import run

if __name__ == "__main__":
    run()
