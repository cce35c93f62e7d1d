"""Extending a parked slot vs re-prefilling the whole context (issue 55: multi-turn episodes).

  JAX_PLATFORMS=cpu python -m benchmarks.bench_extend [--contexts 64,512,4096] [--observation 16] [--reps 7]

A 2-turn episode's second turn starts from a context of C tokens (prompt + first turn) plus an
observation of m tokens. The sampler appends the observation to the parked slot's KV cache
(`Engine.extend`: m positions of prefill attending to the C cached ones); a sampler without it
re-prefills the whole C + m context and inserts it into a slot (`Engine.prefill` + `Engine.insert`),
as a fresh request would. Both are timed on the same tiny model and slotted engine, alternating, each
call to completion (median of --reps after a warm-up that compiles), and the figures printed with the
machine's CPU model and load average (another process makes every figure slower: compare side by side).
The paged cache's extend is tested for equality (tests/test_multiturn_sampler.py), not timed here: on CPU
its decode kernel runs in Pallas interpret mode, whose speed means nothing.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import app, flags

from benchmarks.machine import cpu_model
from jaxrl_async.model import init_params, presets
from jaxrl_async.sampler import Engine, SamplerConfig
from jaxrl_async.sharding import SAMPLER_RULES, make_mesh

FLAGS = flags.FLAGS
flags.DEFINE_list("contexts", ["64", "512", "4096"], "context lengths C before the observation")
flags.DEFINE_integer("observation", 16, "observation tokens m")
flags.DEFINE_integer("reps", 7, "timed repetitions of each (median)")
flags.DEFINE_string("json_out", None, "write the results here as JSON")


def build(contexts: list[int], m: int) -> Engine:
    longest = max(contexts) + m
    model = presets.tiny(vocab_size=128, max_seq_len=longest + 2 * m)
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    params = init_params(model, jax.random.key(0), mesh, SAMPLER_RULES)
    # Exact buckets: the observation's (extend pads it to a bucket) and each whole context's (the
    # re-prefill's and extend's view), so neither side computes padding the other does not.
    buckets = tuple(sorted({m} | {c + m for c in contexts}))
    cfg = SamplerConfig(num_slots=1, max_prompt_len=longest, prompt_buckets=buckets, max_new_tokens=m,
                        steps_per_call=1, temperature=0.0, attention="xla", linear="xla")  # fmt: skip
    return Engine(model, params, mesh, cfg)


def time_context(engine: Engine, c: int, m: int, reps: int) -> dict:
    rng = np.random.default_rng(c)
    context = rng.integers(3, 128, c).astype(np.int32)
    observation = rng.integers(3, 128, m).astype(np.int32)
    parked = engine.prefill(context)  # the slot's state at the end of turn 1: C tokens, the last pending
    state = engine.init_state()

    def extend():
        nonlocal state
        state = engine.insert(state, parked, 0, 0, 0, m)  # untimed: put the parked context back
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        state = engine.extend(state, 0, c, observation, m)
        jax.block_until_ready(state)
        return time.perf_counter() - t0

    def reprefill():
        nonlocal state
        t0 = time.perf_counter()
        prefix = engine.prefill(np.concatenate([context, observation]))
        state = engine.insert(state, prefix, 0, 0, 0, m)
        jax.block_until_ready(state)
        return time.perf_counter() - t0

    extend(), reprefill()  # compile
    ext, pre = [], []
    for _ in range(reps):
        ext.append(extend())
        pre.append(reprefill())
    e, p = float(np.median(ext)), float(np.median(pre))
    return {"context": c, "observation": m, "extend_ms": 1e3 * e, "reprefill_ms": 1e3 * p, "speedup": p / e}


def main(_):
    contexts = [int(c) for c in FLAGS.contexts]
    m = FLAGS.observation
    engine = build(contexts, m)
    rows = [time_context(engine, c, m, FLAGS.reps) for c in contexts]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "load_average": os.getloadavg(),
        "model": "presets.tiny (d_model 128, 2 layers), float32, slotted cache, 1 device",
        "rows": rows,
    }
    print(json.dumps(result, indent=1))
    print(f"\n{'context':>8} {'obs':>4} {'extend ms':>10} {'re-prefill ms':>14} {'ratio':>6}")
    for r in rows:
        print(f"{r['context']:>8} {r['observation']:>4} {r['extend_ms']:>10.2f} {r['reprefill_ms']:>14.2f} "
              f"{r['speedup']:>6.1f}")  # fmt: skip
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
