"""The main job: `jaxrl-run --config=configs/tiny_arith.py --config.workdir=DIR` (or `python launch/run.py`).

One program on every process of a run. Alone it runs every role; with several processes (launch/
local_cluster.py, launch/tpu_pod.sh, launch/slurm_gpu.sbatch) each process is told how to reach the JAX
coordination service (flags, or JAXRL_COORDINATOR / JAXRL_NUM_PROCESSES / JAXRL_PROCESS_ID; on Cloud TPU
and SLURM JAX finds them itself) and plays the roles that config.mesh gives its process id.

The config and the process layout are validated before anything connects or compiles. If any process
fails, every other one stops within seconds (or, if it died without a word, within the heartbeat
timeout) with an error that names it.
"""

import logging as std_logging
import os
import sys
import traceback

from absl import app, flags, logging
from ml_collections import config_flags

from jaxrl_async.cli import run_command

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (configs/*.py).", lock_config=True)
_COORD = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0's coordination service.")
_NUM = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
_PID = flags.DEFINE_integer("process_id", None, "This process's id, in [0, num_processes).")
_INIT = flags.DEFINE_integer("init_timeout_s", 300, "Seconds to wait for every process to join.")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_s", 20, "A process silent this long is dead: every other process then stops."
)
_REPLAY = flags.DEFINE_string(
    "replay",
    None,
    "Replay the run recorded in this workdir (its schedule/) in one process, with --config "
    "as the run's (a changed field shows where it parts from the run); docs/reproducibility.md.",
)
_REPLAY_TO = flags.DEFINE_integer("replay_to", None, "With --replay: stop after training this version.")
_REPLAY_FROM = flags.DEFINE_integer(
    "replay_from", 0, "With --replay: start at this version, one the run was resumed at (its checkpoint)."
)
flags.mark_flags_as_required(["config"])


def main(argv):
    del argv
    from jaxrl_async.run_config import ConfigError
    from jaxrl_async.runtime import cluster as cl
    from jaxrl_async.runtime.cluster import prepare_devices

    config = _CONFIG.value
    if _REPLAY.value:
        _replay(config)
        return
    try:
        flags_ = cl.Flags.resolve(
            coordinator_address=_COORD.value,
            num_processes=_NUM.value,
            process_id=_PID.value,
            init_timeout_s=_INIT.value,
            heartbeat_timeout_s=_HEARTBEAT.value,
        )
        from jaxrl_async.run_config import validate

        validate(config, num_devices=None)  # the config's own errors first, before connecting
        prepare_devices(config)  # before JAX picks a backend
        cluster = cl.connect(config.mesh, flags_)
    except (ConfigError, cl.ClusterError) as e:
        raise app.UsageError(f"invalid config: {e}") from None
    from jaxrl_async.runtime.checkpoint import CheckpointError
    from jaxrl_async.runtime.orchestrator import run_from_config

    try:
        run_from_config(config, cluster)
    except CheckpointError as e:  # the final checkpoint could not be written (a full disk): say so, stop
        cluster.report_failure(str(e))
        _exit_now(cluster, str(e), 1)
    except ConfigError as e:
        cluster.report_failure(f"invalid config: {e}")
        _exit_now(cluster, f"invalid config: {e}", 2)
    except cl.PeerFailure as e:
        _exit_now(cluster, str(e), 1)
    except BaseException as e:  # noqa: BLE001 - tell the other processes, then stop at once
        cluster.report_failure(f"{type(e).__name__}: {e}")
        if cluster.roles.multi:
            traceback.print_exc()
            _exit_now(cluster, f"{type(e).__name__}: {e}", 1)
        raise
    cl.shutdown(cluster)


def _replay(config) -> None:
    """--replay: one process, every role, following the record (runtime/replay.py); prints the report
    and exits 1 when the replay parts from the run."""
    import json

    from jaxrl_async.run_config import ConfigError, validate
    from jaxrl_async.runtime.cluster import prepare_devices

    try:
        validate(config, num_devices=None)
    except ConfigError as e:
        raise app.UsageError(f"invalid config: {e}") from None
    prepare_devices(config)
    from jaxrl_async.runtime.replay import replay_run

    report = replay_run(config, _REPLAY.value, _REPLAY_TO.value, _REPLAY_FROM.value)
    print(json.dumps({k: v for k, v in report.items() if k != "versions"}), flush=True)
    if not report["identical"]:
        sys.exit(1)


def _exit_now(cluster, message: str, code: int) -> None:
    """Ends this process without JAX's shutdown barrier (which would wait minutes for a dead peer)."""
    print(f"process {cluster.process_id} ({cluster.role}) stops: {message}", file=sys.stderr, flush=True)
    if not cluster.roles.multi:
        sys.exit(code)
    std_logging.shutdown()
    os._exit(code)


def run() -> None:
    # Library chatter (orbax logs every checkpoint file) stays at warnings; our own loggers at info.
    logging.set_verbosity(logging.WARNING)
    std_logging.getLogger("jaxrl_async").setLevel(std_logging.INFO)
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m jaxrl_async.cli.run`: how jaxrl-local-cluster starts each process
    run()
