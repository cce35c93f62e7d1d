"""`python tools/eta_sweep.py ...` = `jaxrl-eta-sweep ...`: see jaxrl_async/cli/eta_sweep.py."""

from jaxrl_async.cli.eta_sweep import run

if __name__ == "__main__":
    run()
