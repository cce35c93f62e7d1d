"""Timing the sampler engine's decode step: shared by benchmarks.bench_decode and benchmarks.bench_kernels."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_async.sampler import Engine, SamplerConfig


def median_time(fn, reps: int, warmup: int = 1) -> float:
    """Median seconds of `fn()` over `reps` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_bandwidth(gib: float = 1.0, reps: int = 10) -> float:
    """Read bandwidth in bytes/s: jitted sum over a float32 array of `gib` GiB."""
    x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    t = median_time(lambda: f(x).block_until_ready(), reps)
    return x.nbytes / t


def bench_engine(cfg, params, mesh, batch, prompt_len, new_tokens, k, fuse=True, **kw) -> Engine:
    """A greedy engine of `batch` slots for prompts of `prompt_len` (one bucket), `k` steps per call;
    `kw`: further SamplerConfig fields (the kernels under test)."""
    scfg = SamplerConfig(
        num_slots=batch,
        max_prompt_len=prompt_len,
        prompt_buckets=(prompt_len,),
        max_new_tokens=new_tokens,
        steps_per_call=k,
        temperature=0.0,
        fuse_projections=fuse,
        **kw,
    )
    return Engine(cfg, params, mesh, scfg)


def fill_slots(eng: Engine, prompt_len: int) -> tuple[dict, tuple]:
    """A decode state with every slot holding the same prompt, and the extra `generate` arguments (the page
    table of a paged cache, whose slots get pages for their whole sequence up front)."""
    state = eng.init_state()
    prefix = eng.prefill(np.arange(1, prompt_len + 1) % eng.model_cfg.vocab_size)
    planner = eng.new_planner()
    n = eng.cfg.max_new_tokens
    for b in range(eng.cfg.num_slots):
        dest = planner.start(b, prompt_len, n, {}, whole=True)
        state = eng.insert(state, prefix, b, seed=b, sample_index=0, max_new_tokens=n, dest=dest)
    return state, planner.device_table()


def engine_step_time(eng: Engine, prompt_len: int, reps: int) -> float:
    """Seconds per decode step with every slot live (generate calls of k steps, mid-sequence)."""
    state, extra = fill_slots(eng, prompt_len)
    box = [state]

    def call():
        box[0], rnd = eng.generate(box[0], *extra)
        rnd.tokens.block_until_ready()

    return median_time(call, reps, warmup=2) / eng.cfg.steps_per_call
