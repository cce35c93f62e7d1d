"""Checks a config's process layout against a cluster before anyone pays for it (the launchers run it).

  jaxrl-check-layout --accelerator=v5p-128 --config=configs/math_8b.py \\
      --config.workdir=gs://BUCKET/runs/m8b --config.model.checkpoint=/data/Qwen3-8B \\
      --config.data.path=/data/math.jsonl
  jaxrl-check-layout --hosts=2 --devices-per-host=8 --config=configs/math_8b.py:h100 ...

Validates the config (as `launch/run.py` does before it connects), derives the roles from the hosts and
the devices per host (`jaxrl_async.runtime.cluster.Roles`) and checks that every mesh fits the processes
it lands on. Prints the layout on stderr and the host count on stdout (for the launcher). Exits 2 with a
message naming the cluster variable (`--source`) and the config field when the layout cannot be placed,
and 3 when the config itself is wrong whatever the cluster (a missing config.workdir), so that a launcher
blames the right thing.

`--new-hosts` (hosts that start empty, a freshly created TPU slice): the workdir, the model checkpoint,
the tokenizer and the data files must be URLs (gs://...) that every host reads; a local path, which no
new host has, is refused (exit 3) naming the field.

A TPU slice's hosts come from its accelerator type (Cloud TPU's naming): v4-N and v5p-N count
TensorCores, two per chip, and a host has 4 chips (v5p-128: 64 chips, 16 hosts); v5litepod-N (v5e) and
v6e-N count chips: up to 8 chips are one host, larger slices are hosts of 4 chips. One JAX device is one
chip (megacore on v4 and v5p).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

from absl import app, flags
from ml_collections import config_flags

from jaxrl_async.cli import run_command
from jaxrl_async.runtime.cluster import tpu_slice

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (configs/*.py).", lock_config=True)
_ACCELERATOR = flags.DEFINE_string("accelerator", "", "A Cloud TPU slice type (v5p-128, v5litepod-16, ...).")
_HOSTS = flags.DEFINE_integer("hosts", 0, "Hosts (one process each), when not a TPU slice.")
_DEVICES = flags.DEFINE_integer("devices-per-host", 0, "Accelerators per host, when not a TPU slice.")
_SOURCE = flags.DEFINE_string("source", "", "Where the numbers come from, for messages (default: the flags).")
_NEW_HOSTS = flags.DEFINE_bool("new-hosts", False, "The hosts start empty (a new TPU slice): every path the "
                               "run reads or writes must be a bucket URL (gs://...).")
flags.mark_flags_as_required(["config"])

class NotReady(ValueError):
    """The config is wrong whatever the cluster (the message names the field)."""


# The fields that name files or folders a run reads or writes; on new hosts each must be a bucket URL.
_STORAGE_FIELDS = ("workdir", "model.checkpoint", "tokenizer", "data.path", "data.eval_path")


def local_paths(config) -> list[str]:
    """`field=value` for each of `_STORAGE_FIELDS` set to a local path ("char" is no path)."""
    found = []
    for field in _STORAGE_FIELDS:
        node = config
        for part in field.split("."):
            node = node.get(part) if node is not None else None
        if node and node != "char" and "://" not in str(node):
            found.append(f"config.{field}={node}")
    return found


def check(config, hosts: int, devices_per_host: int, source: str, new_hosts: bool = False) -> str:
    """The layout `config` gets on `hosts` x `devices_per_host`, in words.

    Raises:
      NotReady: the config is wrong whatever the cluster (an invalid field; with `new_hosts`, a local path
        that no new host has).
      ConfigError / ClusterError: the layout does not fit; the message starts with `source` and names the
        config field.
    """
    from jaxrl_async.run_config import ConfigError, validate
    from jaxrl_async.runtime.cluster import Roles, check_placement

    if new_hosts and (paths := local_paths(config)):
        raise NotReady(
            f"{'; '.join(paths)}: a local path, and the hosts of a new slice start empty (no copy of the "
            "model, the data or a shared disk): put it in a bucket and pass gs://BUCKET/... "
            "(docs/distributed.md, \"Pod storage\")"
        )
    where = f"{source} ({hosts} host(s) x {devices_per_host} devices)"
    with _worker_paths(config) as (local, remote):
        try:
            run = validate(local, num_devices=None)
        except ConfigError as e:
            raise NotReady(str(e)) from None
        try:
            if hosts == 1:  # one process: the device total
                validate(local, num_devices=devices_per_host)
        except ValueError as e:
            raise type(e)(f"{where}: {e}") from None
    for field in remote:
        print(f"config.{field}: not checked here (a bucket, or not on this machine); the run checks it on "
              "the hosts", file=sys.stderr)
    m = run.mesh
    try:
        roles = Roles.from_config(m, hosts, devices_per_host)
        check_placement(m, roles, devices_per_host)
    except ValueError as e:
        raise type(e)(f"{where}: {e}") from None
    if not roles.multi:
        return f"{where}: one process runs every role (sampler {m.sampler}, trainer {m.trainer})"
    replicas = ", ".join("+".join(map(str, r)) for r in roles.replicas)
    used = m.trainer_devices + len(roles.replicas) * m.sampler_devices
    idle = hosts * devices_per_host - used  # a mesh smaller than its processes leaves the rest unused
    return (
        f"{where}: trainer processes {list(roles.trainers)} (config.mesh.trainer={m.trainer}), "
        f"{len(roles.replicas)} sampler replica(s) on processes [{replicas}] "
        f"(config.mesh.sampler={m.sampler})" + (f"; {idle} of {used + idle} devices idle" if idle else "")
    )


_PATHS = {"model.checkpoint": True, "data.path": False, "data.eval_path": False}  # field -> a directory


@contextlib.contextmanager
def _worker_paths(config):
    """`config`, with the paths that only the cluster's hosts read (a bucket, a checkpoint on the workers'
    disks) replaced by empty local stand-ins, so that everything else validates here; and those fields."""
    local, remote = config.copy_and_resolve_references(), []
    with tempfile.TemporaryDirectory() as tmp:
        with local.unlocked():
            for field, is_dir in _PATHS.items():
                section, name = field.split(".")
                path = local[section].get(name)
                # A bucket URL is read by the run on the hosts (this machine may have no credentials).
                if path and ("://" in path or not os.path.exists(path)):
                    remote.append(field)
                    stand_in = os.path.join(tmp, name)
                    os.makedirs(stand_in) if is_dir else open(stand_in, "w").close()
                    local[section][name] = stand_in
        yield local, remote


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    from jaxrl_async.run_config import ConfigError
    from jaxrl_async.runtime.cluster import ClusterError

    if _ACCELERATOR.value:
        try:
            hosts, per_host = tpu_slice(_ACCELERATOR.value)
        except ValueError as e:
            raise app.UsageError(f"{_SOURCE.value or '--accelerator'}: {e}") from None
        source = _SOURCE.value or f"--accelerator={_ACCELERATOR.value}"
    elif _HOSTS.value > 0 and _DEVICES.value > 0:
        hosts, per_host = _HOSTS.value, _DEVICES.value
        source = _SOURCE.value or f"--hosts={hosts} --devices-per-host={per_host}"
    else:
        raise app.UsageError("give --accelerator, or --hosts and --devices-per-host (both >= 1)")
    try:
        print(check(_CONFIG.value, hosts, per_host, source, _NEW_HOSTS.value), file=sys.stderr)
    except NotReady as e:
        print(f"config check failed: {e}", file=sys.stderr)
        return 3
    except (ConfigError, ClusterError) as e:
        print(f"layout check failed: {e}", file=sys.stderr)
        return 2
    print(hosts)
    return 0


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":
    run()
