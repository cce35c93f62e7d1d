"""Run checkpoints with orbax: the trainer state (sharded) and the coordinator's state (data cursor and
admission count, JSON), saved together.

In a multi-process run only the trainer processes take part (orbax's `active_processes`). The learner
lead must be process 0: orbax 0.12.8 writes array metadata, host (numpy) arrays and the JSON part from
process 0 only (a run whose trainer state lives on one process saves it through host memory, see
`_host_local`).

The directory may be a bucket (gs://...): orbax and tensorstore write there directly, and every other
path here goes through `jaxrl_async.storage` (never `os.path`, which would make `gs://b/run` a local folder).

Beside the steps, `model.json` records the model config and tokenizer, so a policy can be loaded from a run
directory alone (`load_policy`, used by jaxrl-generate).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as cm

from jaxrl_async import storage
from jaxrl_async.model import ModelConfig, abstract_params
from jaxrl_async.model import lora as lora_lib
from jaxrl_async.model.config import RopeScaling
from jaxrl_async.runtime import lora_checkpoint

MODEL_FILE = "model.json"
# Where orbax (0.12) writes a step until it is complete: `<step>.orbax-checkpoint-tmp`, renamed to `<step>`
# on commit; a failed write leaves it behind (tests/test_chaos.py checks both).
_PARTIAL = ".orbax-checkpoint-tmp"
log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint that had to be written (the final one) could not be; the message names the version
    and the last good checkpoint, which a resume takes."""


def _items(state) -> dict:
    return {
        "params": state.params,
        "opt_state": state.opt_state,
        "counters": {"version": state.version, "updates": state.updates, "skipped": state.skipped},
    }


def _brief(error: Exception) -> str:
    """The error, its middle cut when long (tensorstore's messages put the cause, e.g. "File too large",
    at the end, after the paths)."""
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text if len(text) <= 400 else f"{text[:200]} ... {text[-180:]}"


def _host_local(x) -> bool:
    """Orbax refuses arrays that one process holds whole in a multi-process run (one trainer process
    beside sampler processes): those are saved and restored through host memory."""
    return isinstance(x, jax.Array) and jax.process_count() > 1 and x.is_fully_addressable


def _savable(tree):
    return jax.tree.map(lambda x: np.asarray(x) if _host_local(x) else x, tree)


def _target(x):
    if _host_local(x):
        return np.zeros(x.shape, x.dtype)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


class RunCheckpoints:
    """An orbax CheckpointManager keyed by policy version.

    Saves only when the trainer is idle (the caller's contract): the train step donates the state's buffers.
    Saves are asynchronous: the caller is held while the arrays are copied out, orbax writes the files in
    the background, and a step's directory appears (atomically renamed) only once complete, so a run
    killed mid-write leaves the previous checkpoints intact. A background write that fails (a full disk)
    is reported by the next save or `close`: a warning names the version and the last good checkpoint,
    its partial files are removed, the run goes on and the next save tries again; a save that waits
    (the final one) raises `CheckpointError` instead. The newest `keep` checkpoints are kept, plus
    the one with the best held-out accuracy. Restoring targets the live state's shardings, so a checkpoint
    restores onto whatever mesh the run has; an unreadable newest checkpoint is skipped with a warning
    that names it, and the one before is used.
    """

    def __init__(self, directory: str, keep: int = 3, processes=None):
        """`processes`: the trainer processes of a multi-process run (None: every process)."""
        self.directory = storage.resolve(directory)
        mp = ocp.options.MultiprocessingOptions(
            primary_host=0,
            active_processes=None if processes is None else set(processes),
            barrier_sync_key_prefix=None if processes is None else "trainers",
        )
        if processes is not None:  # orbax creates the root itself only when every process takes part
            storage.makedirs(self.directory)
        policy = cm.AnyPreservationPolicy(
            [
                cm.LatestN(n=keep),
                cm.BestN(
                    get_metric_fn=lambda m: m["eval_accuracy"], n=1, keep_checkpoints_without_metrics=False
                ),
            ]
        )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy, create=processes is None, multiprocessing_options=mp
        )
        handlers = None
        if processes is not None:
            # Handlers made by orbax's registry take part on every process; ours only on the trainers.
            handlers = {
                "state": ocp.StandardCheckpointHandler(multiprocessing_options=mp),
                "coordinator": ocp.JsonCheckpointHandler(multiprocessing_options=mp),
            }
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self.failures = 0  # saves whose write failed (each warned about)
        self._pending: int | None = None  # the version being written in the background

    def save(
        self, version: int, state, coordinator: dict, metrics: dict | None = None, wait: bool = False
    ) -> float:
        """Saves `state` and the coordinator's JSON-able state as step `version`; returns the seconds the
        caller was held (the copy out of the state; all of the write with `wait`).

        Raises:
          CheckpointError: with `wait`, the write failed (without it, a failure is a warning).
        """
        self._settle()
        if version in (self.manager.all_steps() or []):
            return 0.0
        t0 = time.perf_counter()
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(_savable(_items(state))), coordinator=ocp.args.JsonSave(coordinator)
        )
        try:
            self.manager.save(version, args=args, metrics=metrics)
            if wait:
                self.manager.wait_until_finished()
            else:
                self._pending = version
        except Exception as e:  # noqa: BLE001 - any write error (EFBIG, ENOSPC, EIO ...): see _failed
            if not wait:
                self._failed(version, e)
                return time.perf_counter() - t0
            last = self._failed(version, e, going_on=False)
            raise CheckpointError(
                f"{self.directory}: the checkpoint of version {version} could not be written "
                f"({_brief(e)}); the last good checkpoint is {last}: free space and run the same command "
                "to resume from it"
            ) from None
        return time.perf_counter() - t0

    def _settle(self) -> None:
        """Collects the outcome of the previous background write (a failure is warned about)."""
        if self._pending is None:
            return
        version, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - see _failed
            self._failed(version, e)

    def _failed(self, version: int, error: Exception, going_on: bool = True) -> str:
        """Removes a failed write's partial files, re-reads the saved steps from disk (orbax may still
        list the failed one) and warns; returns the last good checkpoint, described."""
        self.failures += 1
        if jax.process_index() == 0:  # orbax's primary host writes the step directory
            for partial in storage.path(self.directory).glob(f"{version}{_PARTIAL}*"):
                try:
                    partial.rmtree()
                except OSError as e:  # a leftover is harmless (orbax skips it); say so and go on
                    log.warning("could not remove the partial checkpoint %s (%s)", partial, e)
        self.manager.reload()
        steps = self.manager.all_steps()
        last = f"version {max(steps)} in {self.directory}" if steps else f"none (in {self.directory})"
        log.warning("checkpoint of version %d failed (%s); the last good checkpoint is %s%s", version,
                    _brief(error), last,
                    "; the run goes on and the next save tries again" if going_on else "")  # fmt: skip
        return last

    def restore_latest(self, state):
        """(state, version, coordinator state) from the newest readable checkpoint, or None."""
        self.manager.reload()
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                return self._restore(state, step)
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: fall back to the previous
                log.warning("checkpoint %s/%d is unreadable (%s: %s); trying the one before", self.directory,
                            step, type(e).__name__, str(e)[:300])  # fmt: skip
        return None

    def restore(self, state, version: int):
        """(state, version, coordinator state) from the checkpoint of `version` (raises if it is not
        there or unreadable)."""
        self.manager.reload()
        return self._restore(state, version)

    def _restore(self, state, step: int):
        live = _items(state)
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(jax.tree.map(_target, live)),
                coordinator=ocp.args.JsonRestore(),
            ),
        )
        place = lambda x, ref: jax.device_put(x, ref.sharding) if _host_local(ref) else x
        r = jax.tree.map(place, out["state"], live)
        c = r["counters"]
        state = state.replace(
            params=r["params"],
            opt_state=r["opt_state"],
            version=c["version"],
            updates=c["updates"],
            skipped=c["skipped"],
        )
        return state, int(step), dict(out["coordinator"] or {})

    def close(self) -> None:
        self._settle()
        self.manager.close()


def write_model_info(directory: str, model_cfg: ModelConfig, tokenizer: str) -> None:
    """Records the model config and tokenizer (a directory or "char") beside a run's checkpoints."""
    storage.makedirs(directory)
    info = {"model": dataclasses.asdict(model_cfg), "tokenizer": tokenizer}
    storage.write_text(storage.join(directory, MODEL_FILE), json.dumps(info, indent=1))


def find_checkpoints(path: str) -> str | None:
    """The checkpoints directory for a run workdir, its checkpoints directory or one step in it."""
    path = storage.resolve(path)
    for d in (path, storage.join(path, "checkpoints"), str(storage.path(path).parent)):
        if storage.exists(storage.join(d, MODEL_FILE)):
            return d
    return None


def load_policy(path: str, mesh, rules, step: int | None = None) -> tuple[ModelConfig, dict, str, int]:
    """Restores only the policy parameters of a run checkpoint onto `mesh` (no optimizer state).

    Args:
      path: a run workdir, its checkpoints directory, or a step directory in it (then that step).
      step: the policy version to load (default: the newest, or the step directory's).

    Returns:
      (model config, params laid out by `rules` on `mesh`, tokenizer, version).

    Raises:
      FileNotFoundError: no model.json beside the checkpoints, or no saved step.
    """
    directory = find_checkpoints(path)
    if directory is None:
        raise FileNotFoundError(f"{path}: no {MODEL_FILE} in it, its checkpoints/ or its parent")
    info = json.loads(storage.read_text(storage.join(directory, MODEL_FILE)))
    m = dict(info["model"])
    if m.get("rope_scaling") is not None:
        m["rope_scaling"] = RopeScaling(**m["rope_scaling"])
    model_cfg = ModelConfig(**m)
    name = storage.path(path).name
    if step is None and storage.resolve(path) != directory and name.isdigit():
        step = int(name)
    manager = ocp.CheckpointManager(directory)
    step = manager.latest_step() if step is None else step
    if step is None or step not in manager.all_steps():
        raise FileNotFoundError(f"{directory}: no checkpoint step {step} (saved: {manager.all_steps()})")
    if lora_checkpoint.is_lora(directory):  # base (saved once) + this step's adapters, merged
        lora, base, adapters = lora_checkpoint.load_lora_policy(directory, model_cfg, mesh, rules, step)
        merged = jax.jit(lambda b, a: lora_lib.merge(b, a, lora))(base, adapters)
        return model_cfg, merged, info["tokenizer"], int(step)
    target = {"params": abstract_params(model_cfg, mesh, rules)}
    restored = ocp.PyTreeCheckpointer().restore(
        storage.join(directory, str(step), "state"),
        args=ocp.args.PyTreeRestore(
            item=target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True,
        ),
    )
    return model_cfg, restored["params"], info["tokenizer"], int(step)
