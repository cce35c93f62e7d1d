"""How many of the sampler's weights change per version: what a delta sync (only the changed values, as
slime sends) would save, measured on a real-shaped model with the trainer's own optimizer.

    python -m benchmarks.bench_delta --preset llama_100m --lrs 1e-6,1e-5,1e-4 --steps 4

For each learning rate, from the same float32 init: the trainer's AdamW (`trainer.optimizer`, constant
rate, one update per version, clipped at global norm 1), real gradients of next-token cross-entropy on a
fixed batch of random tokens, `--steps` versions. After each it casts the masters to the sampler dtype
and counts the values that differ from the previous version's cast. A delta of n changed values costs
n x (4-byte index + the value); a full version costs every value. It prints, per rate, the median changed
fraction and the delta's bytes over a full version's.
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from absl import flags

from jaxrl_async.cli import run_command
from jaxrl_async.model import forward_logits, init_params, presets, token_logprobs
from jaxrl_async.sharding import TRAINER_RULES, make_mesh
from jaxrl_async.trainer import TrainConfig
from jaxrl_async.trainer.optimizer import make_optimizer

_PRESET = flags.DEFINE_string("preset", "llama_100m", "Model shape (jaxrl_async.model.presets).")
_LRS = flags.DEFINE_list("lrs", ["1e-6", "1e-5", "1e-4"], "Learning rates, each from the same init.")
_STEPS = flags.DEFINE_integer("steps", 4, "Versions per learning rate.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch", 2, "Rows of random tokens per gradient.", lower_bound=1)
_SEQ = flags.DEFINE_integer("seq", 64, "Tokens per row.", lower_bound=2)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16"], "The sampler's dtype.")
_INDEX_BYTES = 4  # an int32 position per changed value
_OUT = flags.DEFINE_string("out", "", "Also write the JSON here.")


def measure(preset: str, lrs: list[float], steps: int, batch: int, seq: int, dtype: str) -> dict:
    cfg = presets.get(preset, vocab_size=32000 if preset != "tiny" else 64)
    mesh = make_mesh((1, 1), ("fsdp", "tensor"), jax.devices()[:1])
    params0 = init_params(cfg, jax.random.key(0), mesh, TRAINER_RULES)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, cfg.vocab_size)

    def loss(p):
        logp, _ = token_logprobs(forward_logits(cfg, p, tokens[:, :-1]), tokens[:, 1:])
        return -jnp.mean(logp)

    grad = jax.jit(jax.grad(loss))
    sampler_dtype = jnp.dtype(dtype)

    @jax.jit
    def changed(a, b):
        return sum(jnp.sum(x.astype(sampler_dtype) != y.astype(sampler_dtype)) for x, y in
                   zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))  # fmt: skip

    n = sum(x.size for x in jax.tree.leaves(params0))
    full = n * sampler_dtype.itemsize
    out = {"preset": preset, "values": n, "dtype": dtype, "batch": batch, "seq": seq, "rates": {}}
    for lr in lrs:
        tx = make_optimizer(TrainConfig(lr=lr, total_steps=steps, end_lr_ratio=1.0, minibatches=1))
        params, opt = params0, tx.init(params0)
        fracs, t0 = [], time.perf_counter()
        for _ in range(steps):
            updates, opt = tx.update(grad(params), opt, params)
            new = optax.apply_updates(params, updates)
            fracs.append(int(changed(params, new)) / n)
            params = new
        frac = statistics.median(fracs)
        delta = frac * n * (_INDEX_BYTES + sampler_dtype.itemsize)
        seconds = time.perf_counter() - t0
        out["rates"][str(lr)] = {"changed_frac": fracs, "median_changed_frac": frac,
                                 "delta_over_full": delta / full, "seconds": seconds}  # fmt: skip
    return out


def main(argv) -> None:
    del argv
    lrs = [float(x) for x in _LRS.value]
    out = measure(_PRESET.value, lrs, _STEPS.value, _BATCH.value, _SEQ.value, _DTYPE.value)
    print(f"\n{out['preset']}: {out['values']:,} values, sampler dtype {out['dtype']}, "
          f"{_STEPS.value} versions per rate\n")  # fmt: skip
    print("| learning rate | values changed per version (median) | delta bytes / full | each version |")
    print("|---|---|---|---|")
    for lr, r in out["rates"].items():
        each = ", ".join(f"{f:.2%}" for f in r["changed_frac"])
        print(f"| {float(lr):g} | {r['median_changed_frac']:.2%} | {r['delta_over_full']:.3f} | {each} |")
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(out, f, indent=2)


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":
    run()
