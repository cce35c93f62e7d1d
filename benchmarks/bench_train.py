"""Benchmarks the train step: tokens/s and achieved FLOP/s vs this machine's matmul peak, packing vs padding.

Prints one JSON object (keys include `train_tokens_per_s` and `devices`) and a table. Example:

    python -m benchmarks.bench_train --model llama_100m --rows 8 --budget 256 --steps 3

"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from jaxrl_async.cli import run_command
from jaxrl_async.model import ModelConfig, init_params, presets
from jaxrl_async.perf.hardware import get_hardware
from jaxrl_async.rollouts import Rollout
from jaxrl_async.trainer import (
    TrainConfig,
    compute_advantages,
    create_train_state,
    pack_rollouts,
    pad_rollouts,
    train_step,
)

_MODEL = flags.DEFINE_string("model", "llama_100m", "preset name (jaxrl_async.model.presets)")
_ROWS = flags.DEFINE_integer("rows", 8, "rows per micro-batch", lower_bound=1)
# A row holds the longest synthetic prompt (48 tokens) and a completion.
_BUDGET = flags.DEFINE_integer("budget", 256, "positions per packed row", lower_bound=48)
_STEPS = flags.DEFINE_integer("steps", 3, "timed train steps (after one untimed, compiling)", lower_bound=1)
_TAIL_SEQS = flags.DEFINE_integer(
    "tail-seqs", 32, "sequences in the long-tailed batch (0: no packing test)", lower_bound=0
)
_TAIL_STEPS = flags.DEFINE_integer("tail-steps", 1, "timed steps per layout, packing vs padding", 1)
_MATMUL_N = flags.DEFINE_integer("matmul-n", 4096, "matrix size of the matmul peak", lower_bound=1)
_REMAT = flags.DEFINE_bool("remat", False, "rematerialize activations in the backward pass")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute (masters stay float32)")
_HARDWARE = flags.DEFINE_string(
    "hardware", "", "a jaxrl_async.perf preset (h100, h200, ...): MFU vs its bf16 peak"
)
_JSON_OUT = flags.DEFINE_string("json-out", "", "also write the JSON here")


def matmul_peak_flops(n: int, reps: int, dtype: str = "float32", chain: int | None = None) -> float:
    """Median FLOP/s of `chain` dependent n x n matmuls in one jitted call (the measured roofline; default
    16 on an accelerator, 1 on a CPU). One product per call times the host's dispatch on an accelerator:
    an H200 does n = 4,096 in ~0.2 ms, and one per call measured 160 TFLOP/s. b is scaled by 1/sqrt(n) so
    the chained products stay finite."""
    chain = chain or (1 if jax.default_backend() == "cpu" else 16)
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = (jax.random.normal(jax.random.key(1), (n, n), jnp.float32) / n**0.5).astype(dtype)
    mm = jax.jit(lambda a, b: jax.lax.fori_loop(0, chain, lambda _, c: c @ b, a))
    mm(a, b).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mm(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 * chain / statistics.median(times)


def forward_flops_per_row(cfg: ModelConfig, row_len: int, causal: bool = False) -> float:
    """Matmul FLOPs of one forward over a row; attention counted as computed (the full masked row), or
    with `causal` only its causal half (the model FLOPs that MFU counts)."""
    d, h, g, k, f, v, layers = (
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.ffw_size,
        cfg.vocab_size,
        cfg.n_layers,
    )
    per_token = 2 * (layers * (d * h * k + 2 * d * g * k + h * k * d + 3 * d * f) + d * v)
    attention = layers * 2 * 2 * row_len * row_len * h * k / (2 if causal else 1)
    return per_token * row_len + attention


def long_tailed_rollouts(n: int, max_len: int, vocab: int, seed: int) -> list[Rollout]:
    """Prompts of 16-48 tokens and Pareto-tailed completions (most short, a few up to the cap)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(rng.integers(16, 49))
        c = int(min(max_len - p + 1, 8 + rng.pareto(1.2) * 24))
        out.append(
            Rollout.for_trainer(
                rng.integers(0, vocab, p),
                rng.integers(0, vocab, c),
                -3.0 + 0.1 * rng.normal(size=c),
                [0] * c,
                float(rng.integers(0, 2)),
                i // 8,
            )
        )
    return out


def uniform_rollouts(rows: int, budget: int, vocab: int, seed: int) -> list[Rollout]:
    """Full rows: one sequence of exactly `budget` positions per row (the FACTS.md throughput shape)."""
    rng = np.random.default_rng(seed)
    return [
        Rollout.for_trainer(
            rng.integers(0, vocab, 32),
            rng.integers(0, vocab, budget - 31),
            -3.0 + 0.1 * rng.normal(size=budget - 31),
            [0] * (budget - 31),
            float(i % 2),
            i // 4,
        )
        for i in range(rows)
    ]


def time_steps(state, batch, steps: int):
    """(state, median seconds per step) over `steps` train steps (compile already done by the caller)."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = train_step(state, batch)
        jax.block_until_ready((state.params, m))
        times.append(time.perf_counter() - t)
    return state, statistics.median(times)


def main(argv) -> None:
    del argv
    rows, budget, dtype = _ROWS.value, _BUDGET.value, _DTYPE.value
    model = presets.get(_MODEL.value, dtype=dtype, param_dtype="float32")
    cfg = TrainConfig(lr=1e-5, token_budget=budget, rows_per_micro=rows, remat=_REMAT.value, minibatches=1)
    params = init_params(model, jax.random.key(0))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    peak = matmul_peak_flops(_MATMUL_N.value, reps=5, dtype=dtype)

    # Throughput: one micro-batch of full rows.
    full = uniform_rollouts(rows, budget, model.vocab_size, seed=0)
    adv = compute_advantages(cfg.advantage, [r.reward for r in full], [r.group_id for r in full])
    batch = pack_rollouts(full, adv, budget, rows)
    state = create_train_state(cfg, model, params)
    t0 = time.perf_counter()
    state, _ = train_step(state, batch)
    jax.block_until_ready(state.params)
    first_step_s = time.perf_counter() - t0
    state, step_s = time_steps(state, batch, _STEPS.value)
    tokens = int((batch.arrays["segment_ids"] > 0).sum())
    flops = 3 * forward_flops_per_row(model, budget) * rows  # forward + backward (2x forward)
    achieved = flops / step_s

    packing = None
    if _TAIL_SEQS.value:
        packing = _packing_comparison(cfg, model, state, _TAIL_SEQS.value, _TAIL_STEPS.value)
    result = {
        "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind,
        "model": _MODEL.value,
        "params": int(n_params),
        "dtype": dtype,
        "attention": model.attention,
        "micro_batch": [rows, budget],
        "remat": _REMAT.value,
        "matmul_peak_flops": peak,
        "first_step_s": first_step_s,
        "step_s": step_s,
        "train_tokens_per_s": tokens / step_s,
        "achieved_flops": achieved,
        "fraction_of_matmul_peak": achieved / peak,
        "packing": packing,
        "command": " ".join(["python", *sys.argv] if sys.argv[0].endswith(".py") else sys.argv),
    }
    if _HARDWARE.value:
        hw = get_hardware(_HARDWARE.value)
        result["hardware"] = {"name": hw.name, "peak_flops": hw.peak_flops}
        model_flops = 3 * forward_flops_per_row(model, budget, causal=True) * rows
        result["mfu"] = model_flops / step_s / hw.peak_flops
    print(json.dumps(result, indent=2))
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(result, f, indent=2)
    lines = [
        ("model / params", f"{_MODEL.value} / {n_params / 1e6:.1f}M, {dtype} compute"),
        ("micro-batch", f"{rows} x {budget}"),
        (f"matmul peak ({dtype})", f"{peak / 1e9:.1f} GFLOP/s"),
        ("train step (median)", f"{step_s:.2f} s"),
        ("train tokens/s", f"{tokens / step_s:.1f}"),
        ("achieved", f"{achieved / 1e9:.1f} GFLOP/s = {100 * achieved / peak:.0f}% of matmul peak"),
    ]
    if "mfu" in result:
        lines.append(("MFU", f"{100 * result['mfu']:.0f}% of {_HARDWARE.value}'s bf16 peak"))
    if packing:
        lines += [
            ("long-tailed batch", f"{packing['sequences']} seqs, {packing['tokens']} tokens"),
            (
                "packed",
                f"{packing['packed']['micro_batches']} micro-batches, fill {packing['packed']['fill']:.0%}, "
                f"{packing['packed']['tokens_per_s']:.1f} tok/s",
            ),
            (
                "padded",
                f"{packing['padded']['micro_batches']} micro-batches, fill {packing['padded']['fill']:.0%}, "
                f"{packing['padded']['tokens_per_s']:.1f} tok/s",
            ),
            ("packing speedup", f"{packing['speedup']:.2f}x"),
        ]
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k:<{width}}  {v}")


def _packing_comparison(cfg: TrainConfig, model, state, tail_seqs: int, tail_steps: int) -> dict:
    """Packing vs padding on the same long-tailed rollouts, same compiled micro-batch shape."""
    budget, rows = cfg.token_budget, cfg.rows_per_micro
    tail = long_tailed_rollouts(tail_seqs, budget, model.vocab_size, seed=1)
    tail_adv = compute_advantages(cfg.advantage, [r.reward for r in tail], [r.group_id for r in tail])
    layouts = {
        "packed": pack_rollouts(tail, tail_adv, budget, rows),
        "padded": pad_rollouts(tail, tail_adv, row_len=budget, rows_per_micro=rows),
    }
    tail_tokens = int((layouts["packed"].arrays["segment_ids"] > 0).sum())
    packing = {"sequences": len(tail), "tokens": tail_tokens}
    for name, b in layouts.items():
        state, s = time_steps(state, b, tail_steps)
        packing[name] = {
            "micro_batches": b.num_micro,
            "fill": tail_tokens / b.arrays["tokens"].size,
            "step_s": s,
            "tokens_per_s": tail_tokens / s,
        }
    packing["speedup"] = packing["packed"]["tokens_per_s"] / packing["padded"]["tokens_per_s"]
    return packing


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m benchmarks.bench_train`
    run()
