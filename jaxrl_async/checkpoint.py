"""Run checkpoints with orbax: trainer state (sharded) and the prompt iterator's position, saved together."""

from __future__ import annotations

import os

import grain
import jax
import orbax.checkpoint as ocp


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
