"""Times a run's sampler and trainer, each alone, on the run's devices: input of the shared-host model.

  python -m benchmarks.bench_roles --config=configs/tiny_arith.py --config.workdir=/tmp/roles --batches 6 \
      --out roles.json

Builds the run exactly as `jaxrl-run` does (config validated
first, cached warm start), then measures one train batch of sampling drained from empty slots (sync RL),
the steady stream rate (async RL), and train step + weight sync, each with the process CPU seconds spent.
`jaxrl-perf --roles-bench` turns one or more of these files into predictions (docs/performance-model.md,
"Shared host").

With --corun, the process times one role only, while a second one, started with the other role and the
same --corun_dir, runs beside it (on the cores of the layout under test; `benchmarks/bench_learning.py` starts
the pair for --async-cpu-sets=0,1:1): how much the two slow each other where they share a core.
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
_CORUN = flags.DEFINE_enum(
    "corun", None, ["sampler", "trainer"], "time this role while the other runs beside it"
)
_CORUN_DIR = flags.DEFINE_string("corun_dir", None, "--corun: the directory where the two processes meet")
_CORUN_S = flags.DEFINE_float("corun_seconds", 12.0, "--corun: seconds of the timed window", lower_bound=0.1)
flags.mark_flags_as_required(["config"])
flags.register_multi_flags_validator(
    ["corun", "corun_dir"],
    lambda f: f["corun"] is None or bool(f["corun_dir"]),
    "--corun needs --corun_dir (where the two processes meet)",
)


def main(argv):
    del argv
    from jaxrl_async.runtime.cluster import prepare_devices

    config = _CONFIG.value
    prepare_devices(config)  # before JAX picks a backend
    from jaxrl_async.run_config import ConfigError
    from jaxrl_async.runtime.build import build_local
    from jaxrl_async.runtime.calibration import Rendezvous, calibrate_roles, calibration_config, corun_role

    try:
        proc = build_local(calibration_config(config))
    except ConfigError as e:
        raise app.UsageError(f"invalid config: {e}") from None
    try:
        if _CORUN.value:
            peer = "trainer" if _CORUN.value == "sampler" else "sampler"
            meet = Rendezvous(_CORUN_DIR.value, _CORUN.value, peer)
            result = corun_role(proc, _CORUN.value, _CORUN_S.value, meet)
        else:
            result = calibrate_roles(proc, _BATCHES.value)
        if _DECODE.value and not _CORUN.value:
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


if __name__ == "__main__":  # `python -m benchmarks.bench_roles`: how the benchmarks start it
    run()
