"""`python tools/plan_check.py ...` = `jaxrl-plan-check ...`: see jaxrl_async/cli/plan_check.py."""

from jaxrl_async.cli.plan_check import run

if __name__ == "__main__":
    run()
