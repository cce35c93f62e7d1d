"""Processes and their roles: `jax.distributed` start-up, peer addresses, failure reports, barriers.

A run is one program on every process (one controller per host). `config.mesh.sampler_processes` and
`config.mesh.trainer_processes` say which processes sample (each runs one sampler replica over its own
devices) and which train (together they run one SPMD train step over the trainer mesh); the first trainer
process is the *learner lead*: it hosts the coordinator, the TensorBoard writer and the message hub. With
both lists empty a single process runs every role, as on a laptop; several processes then take their
roles from the meshes and the devices per process (`Roles.from_topology`), and a replica larger than one
process takes several whole ones: its leader runs the actor, the others run its decode calls with it
(`jaxrl_async.runtime.replica`).

JAX's coordination service (started by `jax.distributed.initialize`) is the cluster manager: its heartbeats
end every process when one dies (within `heartbeat_timeout_s`), its key-value store carries peer addresses
and failure reports, and its barriers fence start-up and shutdown. Nothing here replaces it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import time
from collections.abc import Sequence

from jaxrl_async.runtime import secret
from jaxrl_async.runtime.errors import ClusterError

log = logging.getLogger(__name__)

_FAILED = "jaxrl/failed/"  # key prefix: process id -> why it stopped
ENV = {"coordinator_address": "JAXRL_COORDINATOR", "num_processes": "JAXRL_NUM_PROCESSES",
       "process_id": "JAXRL_PROCESS_ID"}  # fmt: skip


class PeerFailure(RuntimeError):
    """Another process of the run failed; the message names it and its role."""


@dataclasses.dataclass(frozen=True)
class Roles:
    """Which process plays which role.

    Attributes:
      num_processes: processes in the run.
      samplers: process ids that run a sampler replica (an actor), in actor order: each replica's leader.
      trainers: process ids that run the learner; trainers[0] is the learner lead.
      replicas: each replica's processes, its leader first (default: one process per replica).
    """

    num_processes: int
    samplers: tuple[int, ...]
    trainers: tuple[int, ...]
    replicas: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        if not self.replicas:
            object.__setattr__(self, "replicas", tuple((p,) for p in self.samplers))

    @classmethod
    def from_config(cls, mesh, num_processes: int, devices_per_process: int | None = None) -> Roles:
        """The roles of `config.mesh` (validated against `num_processes`, errors name the field).

        With both role lists empty and several processes the roles follow from the meshes and
        `devices_per_process` (`from_topology`)."""
        s, t = tuple(mesh.sampler_processes), tuple(mesh.trainer_processes)
        if not s and not t:
            if num_processes == 1:
                return cls(1, (0,), (0,))
            if devices_per_process is None:
                raise ClusterError(
                    f"--num_processes={num_processes}: set config.mesh.devices_per_process (the roles then "
                    "follow from config.mesh.sampler and trainer), or config.mesh.sampler_processes and "
                    "config.mesh.trainer_processes (e.g. (0,) and (1,))"
                )
            return cls.from_topology(mesh, num_processes, devices_per_process)
        if not s or not t:
            empty = "sampler_processes" if not s else "trainer_processes"
            raise ClusterError(f"config.mesh.{empty}: empty while the other role list is set")
        if mesh.sampler_replicas and mesh.sampler_replicas != len(s):
            raise ClusterError(
                f"config.mesh.sampler_replicas={mesh.sampler_replicas} but config.mesh.sampler_processes={s} "
                f"names {len(s)}"
            )
        if num_processes == 1 and s == t == (0,):
            return cls(1, s, t)
        every = set(range(num_processes))
        for name, ids in (("sampler_processes", s), ("trainer_processes", t)):
            bad = [p for p in ids if p not in every]
            if bad or len(set(ids)) != len(ids):
                raise ClusterError(
                    f"config.mesh.{name}={ids}: ids must be distinct and in [0, {num_processes}) "
                    f"(--num_processes={num_processes})"
                )
        both = set(s) & set(t)
        if both:
            raise ClusterError(
                f"config.mesh.sampler_processes={s} and trainer_processes={t} share process(es) "
                f"{sorted(both)}; with several processes each process has one role"
            )
        if t[0] != 0:
            raise ClusterError(
                f"config.mesh.trainer_processes={t}: must start with process 0, the learner lead (process "
                "0 hosts the coordination service and is the only process orbax writes checkpoint metadata "
                "from)"
            )
        missing = sorted(every - set(s) - set(t))
        if missing:
            raise ClusterError(
                f"--num_processes={num_processes} but process(es) {missing} are in neither "
                f"config.mesh.sampler_processes={s} nor config.mesh.trainer_processes={t}"
            )
        return cls(num_processes, s, t)

    @classmethod
    def from_topology(cls, mesh, num_processes: int, devices_per_process: int) -> Roles:
        """Roles from the meshes: processes 0.. train, then each sampler replica takes whole processes.

        A mesh smaller than a process takes one process (its first devices); a larger one a whole number
        of processes. Every process gets a role; the numbers must add up exactly.
        """
        dpp = devices_per_process
        if mesh.devices_per_process and mesh.devices_per_process != dpp:
            raise ClusterError(
                f"config.mesh.devices_per_process={mesh.devices_per_process}: the run's processes have "
                f"{dpp} devices each"
            )
        t = processes_for(mesh, "trainer", dpp)
        k = processes_for(mesh, "sampler", dpp)
        rest = num_processes - t
        total = f"{num_processes} processes of {dpp} devices"
        if mesh.sampler_replicas and t + k * mesh.sampler_replicas != num_processes:
            raise ClusterError(
                f"config.mesh.sampler_replicas={mesh.sampler_replicas}: {mesh.sampler_replicas} replicas of "
                f"{k} process(es) (config.mesh.sampler={mesh.sampler}) + the trainer's {t} "
                f"(config.mesh.trainer={mesh.trainer}) = {t + k * mesh.sampler_replicas} processes of {dpp} "
                f"devices; the run has {num_processes}"
            )
        if rest < k:
            raise ClusterError(
                f"config.mesh.trainer={mesh.trainer} takes {t} of the {total}, leaving {max(rest, 0)}; "
                f"a sampler replica (config.mesh.sampler={mesh.sampler}) needs {k}"
            )
        if rest % k:
            raise ClusterError(
                f"config.mesh.sampler={mesh.sampler}: the {rest} processes left after the trainer's {t} "
                f"do not divide into replicas of {k} processes ({total})"
            )
        replicas = tuple(tuple(range(t + i * k, t + (i + 1) * k)) for i in range(rest // k))
        return cls(num_processes, tuple(r[0] for r in replicas), tuple(range(t)), replicas)

    @property
    def multi(self) -> bool:
        return self.num_processes > 1

    @property
    def lead(self) -> int:
        """The learner lead: coordinator, message hub, TensorBoard writer, checkpoint primary."""
        return self.trainers[0]

    def role(self, pid: int) -> str:
        names = []
        if pid in self.trainers:
            names.append("learner lead" if pid == self.lead else "trainer")
        for i, members in enumerate(self.replicas):
            if pid in members:
                j = members.index(pid)
                names.append(f"sampler {i}" if j == 0 else f"sampler {i} member {j}")
        return " + ".join(names) or "no role"


def processes_for(mesh, name: str, devices_per_process: int) -> int:
    """Whole processes `config.mesh.<name>` (sampler: one replica) takes at `devices_per_process`."""
    shape = getattr(mesh, name)
    devices = shape[0] * shape[1]
    dpp = devices_per_process
    if devices <= dpp:
        return 1
    if devices % dpp:
        what = "replica" if name == "sampler" else "trainer"
        raise ClusterError(
            f"config.mesh.{name}={shape}: a {devices}-device {what} does not fill whole processes of {dpp} "
            f"devices"
        )
    return devices // dpp


def check_placement(mesh, roles: Roles, devices_per_process: int) -> None:
    """Checks that every role's mesh fits the devices its processes have (before anything compiles).

    Raises:
      ClusterError: naming the config field and the numbers.
    """
    if not roles.multi:  # one process: validate() checks the device total
        return
    dpp = devices_per_process
    if mesh.devices_per_process and mesh.devices_per_process != dpp:
        raise ClusterError(
            f"config.mesh.devices_per_process={mesh.devices_per_process}: the run's processes have {dpp} "
            "devices each"
        )
    if mesh.sampler_devices > dpp:
        k = processes_for(mesh, "sampler", dpp)  # raises unless the replica fills whole processes
        short = [r for r in roles.replicas if len(r) != k]
        if short:
            raise ClusterError(
                f"config.mesh.sampler={tuple(mesh.sampler)}: a {mesh.sampler_devices}-device replica needs "
                f"{k} whole processes of {dpp} devices; replica(s) {[list(r) for r in short]} have "
                f"{sorted({len(r) for r in short})} (config.mesh.sampler_processes names one process per "
                "replica: leave both role lists empty and the roles follow from the topology)"
            )
    have = len(roles.trainers) * dpp
    if mesh.trainer_devices > have:
        raise ClusterError(
            f"config.mesh.trainer={tuple(mesh.trainer)}: needs {mesh.trainer_devices} devices, the trainer "
            f"processes {roles.trainers} have {have} ({dpp} each)"
        )


@dataclasses.dataclass(frozen=True)
class Flags:
    """How to reach the coordination service (flags win over JAXRL_* variables; all None = one process)."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    init_timeout_s: int = 300
    heartbeat_timeout_s: int = 20

    @classmethod
    def resolve(cls, **given) -> Flags:
        """Fills the unset fields from the environment (JAXRL_COORDINATOR, ...); checks their form."""
        values = dict(given)
        for name, var in ENV.items():
            if values.get(name) in (None, "", -1) and os.environ.get(var):
                values[name] = os.environ[var]
        for name in ("num_processes", "process_id"):
            v = values.get(name)
            if v in (None, "", -1):
                values[name] = None
                continue
            try:
                values[name] = int(v)
            except ValueError:
                raise ClusterError(f"--{name}: not an integer: {v!r}") from None
        addr = values.get("coordinator_address") or None
        values["coordinator_address"] = addr
        if addr is not None:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ClusterError(f"--coordinator_address={addr!r}: expected HOST:PORT (e.g. 10.0.0.2:8476)")
        n, pid = values["num_processes"], values["process_id"]
        if n is not None and n < 1:
            raise ClusterError(f"--num_processes={n}: must be >= 1")
        if n is not None and pid is not None and not 0 <= pid < n:
            raise ClusterError(f"--process_id={pid}: must be in [0, --num_processes={n})")
        for name in ("init_timeout_s", "heartbeat_timeout_s"):
            if int(values.get(name, 1)) < 1:
                raise ClusterError(f"--{name}: must be >= 1")
        return cls(**values)

    @property
    def given(self) -> list[str]:
        """The connection flags that are set."""
        return [n for n in ENV if getattr(self, n) is not None]


class Cluster:
    """This process's place in the run: its id, the roles, and the coordination service's client.

    A single-process run has no client: every method is then a cheap no-op.
    """

    def __init__(self, roles: Roles, process_id: int = 0, client=None, host: str = "127.0.0.1"):
        self.roles, self.process_id, self.client, self.host = roles, process_id, client, host
        self._next_check = 0.0

    @property
    def role(self) -> str:
        return self.roles.role(self.process_id)

    @property
    def is_lead(self) -> bool:
        return self.process_id == self.roles.lead

    def publish(self, key: str, value: str) -> None:
        """Makes `value` visible to every process under `key` (the coordination service's store)."""
        if self.client is not None:
            self.client.key_value_set(f"jaxrl/{key}", value)

    def published_under(self, prefix: str) -> int:
        """How many keys have been `publish`ed under `prefix` so far (does not wait)."""
        if self.client is None:
            return 0
        return len(self.client.key_value_dir_get(f"jaxrl/{prefix}"))

    def lookup(self, key: str, timeout_s: float = 3600.0) -> str:
        """Waits up to `timeout_s` for another process to `publish` `key` (checking for failed peers)."""
        if self.client is None:
            raise RuntimeError("lookup needs a multi-process run")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.client.blocking_key_value_get(f"jaxrl/{key}", 2000)
            except Exception as e:  # noqa: BLE001 - the service's deadline error
                self.check_peers(force=True)
                if time.monotonic() > deadline:
                    raise PeerFailure(
                        f"no process published {key!r} within {timeout_s:.0f} s ({e})"
                    ) from None

    def barrier(self, name: str, processes: Sequence[int] | None = None, timeout_s: float = 600.0) -> None:
        """A coordination-service barrier (never a device collective: those can deadlock with transfers)."""
        if self.client is None:
            return
        ids = None if processes is None else sorted(processes)
        try:
            self.client.wait_at_barrier(f"jaxrl/{name}", int(timeout_s * 1000), ids)
        except Exception as e:  # noqa: BLE001
            self.check_peers(force=True)
            raise PeerFailure(f"barrier {name!r} did not complete within {timeout_s:.0f} s ({e})") from None

    def report_failure(self, message: str) -> None:
        """Tells every other process that this one is stopping because of `message` (best effort)."""
        if self.client is None:
            return
        try:
            self.client.key_value_set(f"{_FAILED}{self.process_id}", f"{self.role}: {message}"[:2000])
        except Exception:  # noqa: BLE001 - the service may already be gone; the heartbeat then tells
            pass

    def check_peers(self, force: bool = False, every_s: float = 1.0) -> None:
        """Raises PeerFailure if another process reported a failure (polled at most every `every_s`)."""
        if self.client is None:
            return
        now = time.monotonic()
        if not force and now < self._next_check:
            return
        self._next_check = now + every_s
        try:
            failed = self.client.key_value_dir_get(_FAILED)
        except Exception as e:  # noqa: BLE001 - the coordination service (process 0) is unreachable
            raise PeerFailure(f"the JAX coordination service on process 0 is unreachable ({e})") from None
        others = [(k, v) for k, v in failed if not k.endswith(f"/{self.process_id}")]
        if others:
            key, why = sorted(others)[0]
            pid = int(key.rsplit("/", 1)[1])
            raise PeerFailure(f"process {pid} ({self.roles.role(pid)}) failed: {why}")


def _advertised_host(coordinator_address: str) -> str:
    """The address other processes reach this one at: the interface that routes to the coordinator."""
    host = coordinator_address.rpartition(":")[0].strip("[]")
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


def connect(mesh, flags: Flags) -> Cluster:
    """Validates the process layout, starts `jax.distributed` when the run has several processes.

    Must run before JAX initialises a backend. A run whose config names roles but whose flags give no
    coordinator lets JAX detect the cluster (Cloud TPU, SLURM, ...); so does `--num_processes` alone
    (what launch/tpu_pod.sh and launch/slurm_gpu.sbatch pass: the process count the launcher checked).

    Raises:
      ClusterError: naming the flag or config field (before anything compiles or connects).
    """
    from jaxrl_async.run_config import MeshConfig

    if not isinstance(mesh, MeshConfig):  # config.mesh as the config file gives it
        mesh = MeshConfig(**dict(mesh))
    partial = [n for n in flags.given if n != "num_processes"]
    if partial and len(flags.given) < len(ENV):
        missing = [f"--{n}" for n in ENV if n not in flags.given]
        raise ClusterError(
            f"a multi-process run needs {', '.join(missing)} too (or {', '.join(ENV.values())})"
        )
    if flags.num_processes == 1 or not (flags.given or mesh.sampler_processes or mesh.trainer_processes):
        return Cluster(Roles.from_config(mesh, 1))
    lists = mesh.sampler_processes or mesh.trainer_processes
    dpp = mesh.devices_per_process or None
    if flags.num_processes is not None and (lists or dpp):  # fail before connecting, as far as we can tell
        roles = Roles.from_config(mesh, flags.num_processes, dpp)
        if dpp is not None:
            check_placement(mesh, roles, dpp)
    secret.require()  # every message between the processes is signed with it
    import jax

    try:
        jax.distributed.initialize(
            coordinator_address=flags.coordinator_address,
            num_processes=flags.num_processes,
            process_id=flags.process_id,
            initialization_timeout=flags.init_timeout_s,
            heartbeat_timeout_seconds=flags.heartbeat_timeout_s,
            shutdown_timeout_seconds=60,
        )
    except ValueError as e:  # JAX found no cluster to auto-detect
        raise ClusterError(f"{e} (give --coordinator_address, --num_processes and --process_id)") from None
    except Exception as e:  # noqa: BLE001 - JAX's deadline error does not name our flag
        raise ClusterError(
            f"could not join the run's coordination service at --coordinator_address="
            f"{flags.coordinator_address} within --init_timeout_s={flags.init_timeout_s}: {e}"
        ) from None
    from jax._src.distributed import global_state  # the coordination service's client (as orbax uses it)

    pid, n = jax.process_index(), jax.process_count()
    if flags.num_processes is not None and n != flags.num_processes:
        raise ClusterError(f"--num_processes={flags.num_processes} but JAX found {n} processes")
    roles = Roles.from_config(mesh, n, devices_per_process(jax.devices()))
    address = flags.coordinator_address or global_state.coordinator_address or "127.0.0.1:0"
    cluster = Cluster(roles, pid, global_state.client, _advertised_host(address))
    log.info("process %d of %d: %s", pid, n, cluster.role)
    return cluster


def devices_per_process(devices) -> int:
    """The devices each process has (the same on every process, or ClusterError: roles assume it)."""
    counts: dict[int, int] = {}
    for d in devices:
        counts[d.process_index] = counts.get(d.process_index, 0) + 1
    if len(set(counts.values())) != 1:
        raise ClusterError(f"the processes have different device counts {counts}: roles need equal hosts")
    return next(iter(counts.values()))


def shutdown(cluster: Cluster) -> None:
    """Leaves the run cleanly: every process meets at a barrier, then the service shuts down."""
    if cluster.client is None:
        return
    import jax

    cluster.barrier("end")
    jax.distributed.shutdown()


def prepare_devices(config) -> None:
    """Asks XLA for `config.mesh.fake_cpu_devices` CPU devices (used only when no accelerator is present).

    Must run before JAX is first used. An explicit XLA_FLAGS device count wins. On GPU/TPU hosts the CPU
    device count is irrelevant: the orchestrator meshes the default backend's devices.
    """
    n = int(config.mesh.fake_cpu_devices)
    if n > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        import jax

        jax.config.update("jax_num_cpu_devices", n)


# A Cloud TPU slice's name counts TensorCores (v4, v5p: two per chip) or chips (v5e, v6e).
_CORE_COUNTED = {"v4": 2, "v5p": 2}  # TensorCores per chip in the slice name
_CHIP_COUNTED = ("v5litepod", "v5e", "v6e")


def tpu_slice(accelerator: str) -> tuple[int, int]:
    """(hosts, devices per host) of a Cloud TPU accelerator type.

    Raises:
      ValueError: an accelerator type this does not know (the message says which it knows).
    """
    m = re.fullmatch(r"(v4|v5p|v5litepod|v5e|v6e)-(\d+)", accelerator.strip())
    if not m:
        raise ValueError(
            f"unknown TPU accelerator type {accelerator!r} (known: v4-N, v5p-N, v5litepod-N, v5e-N, v6e-N)"
        )
    family, n = m.group(1), int(m.group(2))
    if family in _CORE_COUNTED:
        cores = _CORE_COUNTED[family]
        chips, rem = divmod(n, cores)
        if rem or chips < 4 or chips % 4:
            raise ValueError(f"{accelerator}: {n} TensorCores is not a whole number of 4-chip hosts")
        return chips // 4, 4
    if n <= 8:
        return 1, n
    if n % 4:
        raise ValueError(f"{accelerator}: {n} chips is not a whole number of 4-chip hosts")
    return n // 4, 4
