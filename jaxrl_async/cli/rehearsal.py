"""A pod rehearsal on localhost: a config's process, role and mesh structure in miniature (no command:
`launch/local_cluster.py --rehearse CONFIG` uses it).

The miniature keeps what decides whether a layout runs: the devices per process, each sampler replica's
mesh, the trainer's tensor axis, the roles derived from them (trainer processes first, then the
replicas), the async mode and η. It shrinks what only costs time: fewer trainer processes (the trainer's
fsdp axis shrinks with them), fewer replicas, a tiny model on fake CPU devices, a few steps. It then
checks what the multi-process tests check: every process exits 0, the sampler's weight checksums equal
the learner's after every sync, η holds, one TensorBoard writer (the learner lead).

With the pod's storage (`storage="bucket"`, the default of `--rehearse`): a GCS emulator on localhost
serves the only place the processes share. The model (a tiny HF checkpoint), the data (a JSONL file) and
the workdir are in the bucket; each process runs in a root of its own (cwd, HOME, TMPDIR), as the hosts
of a pod share no disk. A trainer process can be killed mid-run and the job started again on fresh
roots: it resumes from the bucket, and the ledger in the bucket shows each prompt trained exactly once.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import tempfile

from jaxrl_async import storage
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
    c.trainer.token_budget, c.trainer.rows_per_micro = 64, {rows}{storage}
    return c
'''

# The pod's storage: the model and the data come from the bucket, a checkpoint every step goes there.
_BUCKET_INPUTS = '''
    c.model.preset, c.model.n_layers, c.model.checkpoint = "", 0, {model!r}
    c.data.task, c.data.path = "jsonl", {data!r}
    c.checkpoint_every = 1'''
DATA_ROWS = 64  # train prompts in the bucket's JSONL (a rehearsal trains steps x 4 of them)


def stage_inputs(root: str) -> tuple[str, str]:
    """Writes a tiny HF checkpoint (random weights, the character vocabulary) and a JSONL file of
    additions under `root` (a bucket URL); returns their URLs. What a user uploads before a pod run."""
    import jax
    import numpy as np

    from jaxrl_async.model import init_params, presets, save_hf
    from jaxrl_async.tokenizer import CharTokenizer

    tok = CharTokenizer()
    cfg = presets.get("tiny", vocab_size=-(-tok.vocab_size // 8) * 8, eos_token_id=tok.eos_id)
    params = init_params(cfg, jax.random.key(0), None, None)
    model = storage.join(root, "model")
    with tempfile.TemporaryDirectory() as tmp:  # save_hf writes a local folder; it is then uploaded
        save_hf(cfg, params, tmp)
        for name in sorted(os.listdir(tmp)):
            storage.copy_file(os.path.join(tmp, name), storage.join(model, name))
    rng = np.random.default_rng(0)
    rows = [(int(a), int(b)) for a, b in rng.integers(10, 100, size=(DATA_ROWS, 2))]
    data = storage.join(root, "data", "train.jsonl")
    storage.write_text(data, "".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                     for a, b in rows))  # fmt: skip
    return model, data


def write_config(target: str, workdir: str, mini: Miniature, steps: int, config_dir: str | None = None,
                 inputs: tuple[str, str] | None = None) -> str:
    """Writes the rehearsal's config file (the target's numerics swapped for tiny ones) into `config_dir`
    (default: `workdir`, which must then be local); `inputs`: the bucket's (model, data) URLs."""
    c = load_config(target)
    config_dir = config_dir or workdir
    os.makedirs(config_dir, exist_ok=True)
    path = os.path.join(config_dir, "rehearsal_config.py")
    single = mini.num_processes == 1
    text = _REHEARSAL.format(
        target=target,
        layout=mini.describe(),
        tiny=os.path.join(_CONFIGS, "tiny_arith.py"),
        workdir=storage.resolve(workdir),
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
        storage=_BUCKET_INPUTS.format(model=inputs[0], data=inputs[1]) if inputs else "",
    )
    with open(path, "w") as f:
        f.write(text)
    return path


def verify(workdir: str, mini: Miniature, max_staleness: int, mode: str, launches: int = 1) -> list[str]:
    """What the finished rehearsal shows, one line per check, each starting with "ok" or "FAILED".
    `workdir` may be a bucket URL; `launches`: how many times the job was started in it (a resumed run
    publishes versions from its checkpoint on, and each start has its own TensorBoard writer)."""
    summary = json.loads(storage.read_text(storage.join(workdir, "summary.json")))
    lines = []

    def check(ok: bool, what: str) -> None:
        lines.append(f"{'ok' if ok else 'FAILED'}: {what}")

    check(summary["processes"] == mini.num_processes, f"{summary['processes']} processes ran")
    sums = summary["weight_checksums"]
    learner = {int(k): v for k, v in sums["learner"].items()}
    first = min(learner, default=0) if launches > 1 else 0
    check(sorted(learner) == list(range(first, summary["steps"] + 1)),
          f"versions {first}..{summary['steps']} published")  # fmt: skip
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
    # At most one event file per start, all in tb/ (the learner lead's); a start killed before its events
    # were copied to a bucket leaves none (metrics.MetricsWriter copies them every minute and at the end).
    events = _event_files(workdir)
    one = 1 <= len(events) <= launches and all(d == "tb" for d in events)
    check(one, f"one TensorBoard writer ({len(events)} event file(s) in tb/ for {launches} start(s))")
    if launches > 1 or storage.exists(storage.join(workdir, "trained_uids.jsonl")):
        lines.append(_ledger_check(workdir, summary["steps"]))
    return lines


def _event_files(workdir: str) -> list[str]:
    """The folder (relative to the workdir) of every TensorBoard event file, two levels deep at most."""
    found = []
    for p in storage.path(workdir).iterdir():
        children = list(p.iterdir()) if p.is_dir() else [p]
        found += [p.name if c is not p else "." for c in children if "tfevents" in c.name]
    return found


def _ledger_check(workdir: str, steps: int) -> str:
    """The ledger (trained_uids.jsonl; a version's last line counts after a resume): versions 1..steps,
    and no prompt trained in two of them."""
    last = {}
    for line in storage.read_text(storage.join(workdir, "trained_uids.jsonl")).splitlines():
        row = json.loads(line)
        last[row["version"]] = row["uids"]
    uids = [u for v in sorted(last) for u in last[v]]
    ok = sorted(last) == list(range(1, steps + 1)) and len(uids) == len(set(uids))
    return (f"{'ok' if ok else 'FAILED'}: the ledger: versions {sorted(last)[:1]}..{sorted(last)[-1:]}, "
            f"{len(uids)} prompts trained, {len(uids) - len(set(uids))} of them twice")  # fmt: skip
