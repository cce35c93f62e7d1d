"""The main job: `python launch/run.py --config=configs/tiny_arith.py --config.workdir=DIR`.

Validates the whole config before anything compiles, creates the fake CPU devices the config needs on a
CPU-only machine, then hands over to the orchestrator.
"""

import logging as std_logging
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (configs/*.py).", lock_config=True)
flags.mark_flags_as_required(["config"])


def main(argv):
    del argv
    from jaxrl_async.launch_util import prepare_devices

    config = _CONFIG.value
    prepare_devices(config)  # before JAX picks a backend
    from jaxrl_async.orchestrator import run_from_config
    from jaxrl_async.run_config import ConfigError

    try:
        run_from_config(config)
    except ConfigError as e:
        raise app.UsageError(f"invalid config: {e}") from None


if __name__ == "__main__":
    # Library chatter (orbax logs every checkpoint file) stays at warnings; our own loggers at info.
    logging.set_verbosity(logging.WARNING)
    std_logging.getLogger("jaxrl_async").setLevel(std_logging.INFO)
    app.run(main)
