"""Run checkpoints with orbax: trainer state (sharded) and the prompt iterator's position, saved together.

Beside the steps, `model.json` records the model config and tokenizer, so a policy can be loaded from a run
directory alone (`load_policy`, used by tools/generate.py).
"""

from __future__ import annotations

import dataclasses
import json
import os

import grain
import jax
import orbax.checkpoint as ocp

from jaxrl_async.model import ModelConfig, abstract_params
from jaxrl_async.model.config import RopeScaling

MODEL_FILE = "model.json"


def _items(state) -> dict:
    return {
        "params": state.params,
        "opt_state": state.opt_state,
        "counters": {"version": state.version, "updates": state.updates, "skipped": state.skipped},
    }


class RunCheckpoints:
    """An orbax CheckpointManager keyed by policy version.

    Saves only when the trainer is idle (the caller's contract): the train step donates the state's buffers.
    Restoring targets the live state's shardings, so a checkpoint restores onto whatever mesh the run has.
    """

    def __init__(self, directory: str, max_to_keep: int = 2):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, version: int, state, data_iter) -> None:
        if version in (self.manager.all_steps() or []):
            return
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(_items(state)), data=grain.checkpoint.CheckpointSave(data_iter)
        )
        self.manager.save(version, args=args)
        self.manager.wait_until_finished()

    def restore_latest(self, state, data_iter):
        """(state, version) from the newest checkpoint, restoring `data_iter`'s position; or None."""
        step = self.manager.latest_step()
        if step is None:
            return None
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _items(state)
        )
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), data=grain.checkpoint.CheckpointRestore(data_iter)
            ),
        )
        r = out["state"]
        c = r["counters"]
        state = state.replace(
            params=r["params"],
            opt_state=r["opt_state"],
            version=c["version"],
            updates=c["updates"],
            skipped=c["skipped"],
        )
        return state, int(step)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def write_model_info(directory: str, model_cfg: ModelConfig, tokenizer: str) -> None:
    """Records the model config and tokenizer (a directory or "char") beside a run's checkpoints."""
    os.makedirs(directory, exist_ok=True)
    info = {"model": dataclasses.asdict(model_cfg), "tokenizer": tokenizer}
    with open(os.path.join(directory, MODEL_FILE), "w") as f:
        json.dump(info, f, indent=1)


def find_checkpoints(path: str) -> str | None:
    """The checkpoints directory for a run workdir, its checkpoints directory or one step in it."""
    for d in (path, os.path.join(path, "checkpoints"), os.path.dirname(os.path.abspath(path))):
        if os.path.exists(os.path.join(d, MODEL_FILE)):
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
    with open(os.path.join(directory, MODEL_FILE)) as f:
        info = json.load(f)
    m = dict(info["model"])
    if m.get("rope_scaling") is not None:
        m["rope_scaling"] = RopeScaling(**m["rope_scaling"])
    model_cfg = ModelConfig(**m)
    if step is None and os.path.abspath(path) != directory and os.path.basename(path).isdigit():
        step = int(os.path.basename(path))
    manager = ocp.CheckpointManager(directory)
    step = manager.latest_step() if step is None else step
    if step is None or step not in manager.all_steps():
        raise FileNotFoundError(f"{directory}: no checkpoint step {step} (saved: {manager.all_steps()})")
    target = {"params": abstract_params(model_cfg, mesh, rules)}
    restored = ocp.PyTreeCheckpointer().restore(
        os.path.join(directory, str(step), "state"),
        args=ocp.args.PyTreeRestore(
            item=target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True,
        ),
    )
    return model_cfg, restored["params"], info["tokenizer"], int(step)
