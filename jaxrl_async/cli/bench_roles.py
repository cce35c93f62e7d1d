"""Times a run's sampler and trainer, each alone, on the run's devices: input of the shared-host model.

  jaxrl-bench-roles --config=configs/tiny_arith.py --config.workdir=/tmp/roles --batches 6 --out roles.json

(or `python tools/bench_roles.py ...`). Builds the run exactly as `jaxrl-run` does (config validated
first, cached warm start), then measures one train batch of sampling drained from empty slots (sync RL),
the steady stream rate (async RL), and train step + weight sync, each with the process CPU seconds spent.
`jaxrl-perf --roles-bench` turns one or more of these files into predictions (docs/performance-model.md,
"Shared host").
"""

import json
import logging as std_logging

from absl import app, flags, logging
from ml_collections import config_flags

from jaxrl_async.cli import run_command

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (configs/*.py).", lock_config=True)
_BATCHES = flags.DEFINE_integer("batches", 6, "timed train batches per measurement (>= 2)")
_OUT = flags.DEFINE_string("out", None, "write the JSON here (it is printed either way)")
_DECODE = flags.DEFINE_bool(
    "decode_curve", False, "also time decode steps vs busy slots (the split model's input)"
)
flags.mark_flags_as_required(["config"])


def main(argv):
    del argv
    from jaxrl_async.runtime.cluster import prepare_devices

    config = _CONFIG.value
    prepare_devices(config)  # before JAX picks a backend
    from jaxrl_async.run_config import ConfigError
    from jaxrl_async.runtime.build import build_local
    from jaxrl_async.runtime.calibration import calibrate_roles, calibration_config

    try:
        proc = build_local(calibration_config(config))
    except ConfigError as e:
        raise app.UsageError(f"invalid config: {e}") from None
    try:
        result = calibrate_roles(proc, _BATCHES.value)
        if _DECODE.value:
            from jaxrl_async.runtime.calibration import decode_curve

            result["decode"] = decode_curve(proc)
    finally:
        proc.close()
    text = json.dumps(result, indent=2)
    print(text)
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            f.write(text + "\n")


def run() -> None:
    logging.set_verbosity(logging.WARNING)
    std_logging.getLogger("jaxrl_async").setLevel(std_logging.INFO)
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m jaxrl_async.cli.bench_roles`: how the benchmarks start it
    run()
