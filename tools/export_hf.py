"""`python tools/export_hf.py ...` = `jaxrl-export-hf ...`: see jaxrl_async/cli/export_hf.py."""

from jaxrl_async.cli.export_hf import run

if __name__ == "__main__":
    run()
