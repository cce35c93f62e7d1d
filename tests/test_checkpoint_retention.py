"""Checkpoint retention (config.checkpoint_keep): the newest N versions stay, plus the one with the best
held-out accuracy; versions without an evaluation never count as the best."""

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl_async.runtime.checkpoint import RunCheckpoints


@struct.dataclass
class _State:  # the fields RunCheckpoints saves of a train state
    params: dict
    opt_state: dict
    version: jax.Array
    updates: jax.Array
    skipped: jax.Array


def _state(v: int) -> _State:
    w = jnp.full((4, 4), float(v))
    return _State({"w": w}, {"m": w * 0}, jnp.int32(v), jnp.int32(v), jnp.int32(0))


def test_keeps_the_newest_n_and_the_best(tmp_path):
    directory = str(tmp_path / "checkpoints")
    ckpts = RunCheckpoints(directory, keep=2)
    accuracy = {1: 0.2, 2: 0.9, 3: None, 4: 0.5, 5: None, 6: 0.4}  # version 2 is the best
    for v, acc in accuracy.items():
        ckpts.save(v, _state(v), {"version": v}, None if acc is None else {"eval_accuracy": acc}, wait=True)
    ckpts.close()
    again = RunCheckpoints(directory, keep=2)
    assert again.manager.all_steps() == [2, 5, 6]
    state, version, coordinator = again.restore_latest(_state(0))
    assert version == 6 and coordinator == {"version": 6} and float(state.params["w"][0, 0]) == 6.0
    again.close()
