"""How long a checkpoint holds the trainer: orbax's asynchronous save against a save waited for.

  python -m benchmarks.bench_checkpoint --preset llama_100m --reps 3 --out /tmp/checkpoint.json

Builds a train state (parameters + AdamW moments, float32) of the preset on one CPU device and saves it
with the run's own `RunCheckpoints` (the coordinator's state beside it): the seconds `save` holds the
caller (copying the state out; the files are written in the background while training goes on), the
seconds until the files are complete, and a restore. Medians of `--reps`.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

from absl import flags

from jaxrl_async.cli import run_command

_PRESET = flags.DEFINE_string("preset", "llama_100m", "Model shape (jaxrl_async.model.presets).")
_REPS = flags.DEFINE_integer("reps", 3, "Timed saves and restores (medians are reported).", lower_bound=1)
_OUT = flags.DEFINE_string("out", "", "Also write the JSON here.")


def main(argv) -> None:
    del argv
    preset, reps = _PRESET.value, _REPS.value
    import jax

    from jaxrl_async.model import init_params, presets
    from jaxrl_async.runtime.checkpoint import RunCheckpoints
    from jaxrl_async.sharding import TRAINER_RULES, make_mesh
    from jaxrl_async.trainer import TrainConfig, create_train_state

    cfg = presets.get(preset, vocab_size=32000)
    mesh = make_mesh((1, 1), ("fsdp", "tensor"), jax.devices()[:1])
    state = create_train_state(
        TrainConfig(rows_per_micro=1), cfg, init_params(cfg, jax.random.key(0), mesh, TRAINER_RULES), mesh
    )
    gbytes = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state))) / 1e9
    held, written, restored = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = RunCheckpoints(os.path.join(tmp, "checkpoints"), keep=reps + 2)
        for v in range(reps + 1):
            t0 = time.perf_counter()
            h = ckpt.save(v + 1, state, {"data": {}, "started": 0, "version": v, "in_flight": []})
            ckpt.manager.wait_until_finished()
            if v:  # the first save sets orbax up
                held.append(h)
                written.append(time.perf_counter() - t0)
        for _ in range(reps):
            t0 = time.perf_counter()
            out = ckpt.restore_latest(state)
            jax.block_until_ready(out[0].params)
            restored.append(time.perf_counter() - t0)
        ckpt.close()
    med = statistics.median
    res = {
        "preset": preset,
        "state_gbytes": gbytes,
        "save_holds_trainer_s": med(held),
        "save_complete_s": med(written),
        "restore_s": med(restored),
        "reps": reps,
    }
    print(json.dumps(res, indent=2))
    print(f"\n{preset}: {gbytes:.2f} GB of train state; save holds the trainer {med(held):.2f} s, "
          f"files complete after {med(written):.2f} s; restore {med(restored):.2f} s")  # fmt: skip
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(res, f, indent=2)


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m benchmarks.bench_checkpoint`
    run()
