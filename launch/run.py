"""`python launch/run.py --config=configs/tiny_arith.py --config.workdir=DIR`: the main job (`jaxrl-run`),
documented in jaxrl_async/cli/run.py."""

from jaxrl_async.cli.run import run

if __name__ == "__main__":
    run()
