"""A pod rehearsal on localhost: a config's process, role and mesh structure in miniature (no command:
`launch/local_cluster.py --rehearse CONFIG` uses it).

The miniature keeps what decides whether a layout runs: the devices per process, each sampler replica's
mesh, the trainer's tensor axis, the roles derived from them (trainer processes first, then the
replicas), the async mode and η. It shrinks what only costs time: fewer trainer processes (the trainer's
fsdp axis shrinks with them), fewer replicas, a tiny model on fake CPU devices, a few steps. It then
checks what the multi-process tests check: every process exits 0, the sampler's weight checksums equal
the learner's after every sync, η holds, one TensorBoard writer (the learner lead).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

from jaxrl_async.run_config import ConfigError, MeshConfig
from jaxrl_async.runtime.cluster import Roles, check_placement, processes_for

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CONFIGS = os.path.join(_REPO, "configs")  # the checkout's (the rehearsal runs from one)


def load_config(spec: str):
    """The ConfigDict of `path[:arg]` (a configs/*.py file)."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"--rehearse: no config file {path!r}")
    module_spec = importlib.util.spec_from_file_location("rehearsed_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


@dataclasses.dataclass(frozen=True)
class Miniature:
    """The rehearsal's layout, and the real one it stands for (in words)."""

    num_processes: int
    devices_per_process: int
    sampler: tuple[int, int]
    trainer: tuple[int, int]
    replicas: int
    real: str

    def describe(self) -> str:
        return (
            f"{self.real}; rehearsed as {self.num_processes} process(es) x {self.devices_per_process} CPU "
            f"devices: trainer {self.trainer}, {self.replicas} replica(s) of {self.sampler}"
        )


def miniature(mesh: MeshConfig, trainer_processes: int = 1, replicas: int = 1) -> Miniature:
    """The miniature of `config.mesh`: at most `trainer_processes` trainer processes and `replicas`
    replicas, every mesh on the same devices per process as the real layout.

    Raises:
      ConfigError: the real layout cannot be placed, or its trainer does not shrink (names the field).
    """
    lists = mesh.sampler_processes or mesh.trainer_processes
    if not mesh.devices_per_process and not lists:  # one process plays every role
        n = mesh.devices_needed
        real = f"one process of {n} devices: sampler {mesh.sampler}, trainer {mesh.trainer}"
        return Miniature(1, n, tuple(mesh.sampler), tuple(mesh.trainer), 1, real)
    if not mesh.devices_per_process:
        raise ConfigError("config.mesh.devices_per_process: a rehearsal of a multi-process layout needs it")
    dpp = mesh.devices_per_process
    if lists:
        n_real = len(mesh.sampler_processes) + len(mesh.trainer_processes)
    else:
        n_real = processes_for(mesh, "trainer", dpp) + processes_for(mesh, "sampler", dpp) * (
            mesh.sampler_replicas or 1
        )
    try:
        roles = Roles.from_config(mesh, n_real, dpp)
        check_placement(mesh, roles, dpp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t = min(len(roles.trainers), trainer_processes)
    trainer = tuple(mesh.trainer)
    if t < len(roles.trainers):
        devices, tensor = t * dpp, mesh.trainer[1]
        if devices % tensor:
            raise ConfigError(
                f"config.mesh.trainer={trainer}: its tensor axis {tensor} does not divide the {devices} "
                f"devices of {t} trainer process(es) (rehearse with more)"
            )
        trainer = (devices // tensor, tensor)
    r = min(len(roles.replicas), replicas)
    k = len(roles.replicas[0])
    real = (
        f"{n_real} processes x {dpp} devices: trainer {tuple(mesh.trainer)} on {len(roles.trainers)}, "
        f"{len(roles.replicas)} replica(s) of {tuple(mesh.sampler)}"
    )
    return Miniature(t + k * r, dpp, tuple(mesh.sampler), trainer, r, real)


_REHEARSAL = '''"""Rehearsal of {target}: {layout}."""

from jaxrl_async.cli.config_file import sibling


def get_config():
    c = sibling({tiny!r}, "tiny_arith").get_config()
    c.workdir = {workdir!r}
    c.mode, c.max_staleness = {mode!r}, {max_staleness}
    c.total_steps, c.prompts_per_step, c.samples_per_prompt = {steps}, 4, 4
    c.eval_every, c.checkpoint_every = 0, 0  # the checks need neither; each costs a decode / a save
    c.warm_start.enabled = False
    # A random model never solves addition: "contains a digit" gives every group signal.
    c.reward.reward = "format"
    c.reward.defaults = {{"format_regex": "[0-9]"}}
    c.verify_weights = True
    c.mesh.sampler, c.mesh.trainer = {sampler}, {trainer}
    c.mesh.sampler_replicas, c.mesh.devices_per_process = {replicas}, {dpp}
    c.mesh.fake_cpu_devices = {dpp}
    c.sampler.num_slots = {slots}
    c.sampler.update_mode = {update_mode!r}
    c.trainer.loss, c.trainer.advantage = {loss!r}, {advantage!r}
    c.trainer.token_budget, c.trainer.rows_per_micro = 64, {rows}
    return c
'''


def write_config(target: str, workdir: str, mini: Miniature, steps: int) -> str:
    """Writes the rehearsal's config file into `workdir` (the target's numerics swapped for tiny ones)."""
    c = load_config(target)
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "rehearsal_config.py")
    single = mini.num_processes == 1
    text = _REHEARSAL.format(
        target=target,
        layout=mini.describe(),
        tiny=os.path.join(_CONFIGS, "tiny_arith.py"),
        workdir=os.path.abspath(workdir),
        mode=c.mode,
        max_staleness=c.max_staleness,
        steps=steps,
        sampler=mini.sampler,
        trainer=mini.trainer,
        replicas=0 if single else mini.replicas,
        dpp=0 if single else mini.devices_per_process,
        slots=8 * mini.sampler[0],
        update_mode=c.sampler.update_mode,
        loss=c.trainer.loss,
        advantage=c.trainer.advantage,
        rows=2 * mini.trainer[0],
    )
    with open(path, "w") as f:
        f.write(text)
    return path


def verify(workdir: str, mini: Miniature, max_staleness: int, mode: str) -> list[str]:
    """What the finished rehearsal shows, one line per check, each starting with "ok" or "FAILED"."""
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    lines = []

    def check(ok: bool, what: str) -> None:
        lines.append(f"{'ok' if ok else 'FAILED'}: {what}")

    check(summary["processes"] == mini.num_processes, f"{summary['processes']} processes ran")
    sums = summary["weight_checksums"]
    learner = {int(k): v for k, v in sums["learner"].items()}
    check(sorted(learner) == list(range(summary["steps"] + 1)), f"versions 0..{summary['steps']} published")
    actors = sums["actors"]
    check(len(actors) == mini.replicas, f"{len(actors)} sampler replica(s) reported checksums")
    for name, got in actors.items():
        got = {int(k): v for k, v in got.items()}
        same = sorted(got) == sorted(learner) and all(
            abs(got[v] - learner[v]) <= 1e-6 * max(1.0, abs(learner[v])) for v in learner
        )
        check(same, f"actor {name}: weight checksums equal the learner's after every sync")
    bound = 0 if mode == "sync" else max_staleness
    ahead = summary["max_admission_ahead"]
    check(ahead <= bound,
          f"max_staleness holds: admissions ran at most {ahead} version(s) ahead (bound {bound})")
    events = [os.path.join(d, f) for d, _, fs in os.walk(workdir) for f in fs if "tfevents" in f]
    one = len(events) == 1 and os.path.dirname(events[0]) == os.path.join(workdir, "tb")
    check(one, f"one TensorBoard writer ({len(events)} event file(s))")
    return lines
