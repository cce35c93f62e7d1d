"""Ablation of the sampler's CPU kernels (prints JSON and a table; figures go in docs/sampler.md).

  JAX_PLATFORMS=cpu python -m benchmarks.bench_kernels [--rows 1,4,16,32,64] [--batches 1,8,32] [--json-out F]
      [--march x86-64-v3]

Measures, in one run on one device (llama_100m shapes, float32):
  - read bandwidth (jitted sum over 1 GiB);
  - a chain of the 12 layers' decode matmuls (distinct weights, so they stream from memory) with M input
    rows: XLA's dots on output-major weights vs `cpu_kernels.linear` on packed weights;
  - 12 layers of decode attention at batch 32 (121 of 192 positions valid): XLA einsums vs the kernel;
  - the engine's decode step for every (attention, linear) combination at a few batch sizes.
`--march` builds the kernels for another instruction set than this CPU's (e.g. x86-64-v3: AVX2 without
AVX-512), to see on one machine the blocking another machine gets; it sets JAXRL_ASYNC_KERNEL_MARCH.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from benchmarks.decode_timing import bench_engine, engine_step_time, measure_bandwidth, median_time
from jaxrl_async.cli import run_command
from jaxrl_async.model import init_params, presets
from jaxrl_async.sampler import cpu_kernels, decode
from jaxrl_async.sharding import SAMPLER_RULES, make_mesh

COMBOS = (("xla", "xla"), ("cpu_kernel", "xla"), ("cpu_kernel", "cpu_kernel"))

_ROWS = flags.DEFINE_list("rows", ["1", "4", "16", "32", "64"], "input rows of the matmul chain")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32"], "engine batch sizes (empty: skip)")
_JSON_OUT = flags.DEFINE_string("json-out", None, "also write the JSON here")
_MARCH = flags.DEFINE_string("march", None, "build the kernels with this -march instead of native")


def _best(fn, reps: int = 10) -> float:
    """Best of three medians: the chain and attention calls are short and the machine may be shared."""
    return min(median_time(fn, reps, warmup=2) for _ in range(3))


def matmul_chain(cfg, rows: list[int]) -> list[dict]:
    """Per layer: q|k|v, o, gate|up, down, as in a fused decode step; x stays [M, D]."""
    d, f = cfg.d_model, cfg.ffw_size
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    shapes = [(qkv, d), (d, cfg.n_heads * cfg.head_dim), (2 * f, d), (d, f)]
    rng = np.random.default_rng(0)
    weights = [
        [jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.02) for s in shapes]
        for _ in range(cfg.n_layers)
    ]
    packed = jax.jit(lambda ws: [[cpu_kernels.pack(w) for w in lw] for lw in ws])(weights)
    n_weights = cfg.n_layers * sum(a * b for a, b in shapes)
    hk = cfg.n_heads * cfg.head_dim

    def chain(x, ws, mm):
        for w_qkv, w_o, w_gu, w_down in ws:
            x = x + mm(mm(x, w_qkv)[:, :hk], w_o)  # attention left out: the query feeds the output matmul
            gu = mm(x, w_gu)
            x = x + mm(jax.nn.silu(gu[:, :f]) * gu[:, f:], w_down)
        return x

    dot = lambda a, w: jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())))
    xla = jax.jit(lambda x, ws: chain(x, ws, dot))
    kernel = jax.jit(lambda x, ws: chain(x, ws, cpu_kernels.linear))
    out = []
    for m in rows:
        x = jnp.asarray(rng.standard_normal((m, d), dtype=np.float32))
        ref, got = xla(x, weights), kernel(x, packed)
        t_xla = _best(lambda x=x: xla(x, weights).block_until_ready())
        t_kernel = _best(lambda x=x: kernel(x, packed).block_until_ready())
        out.append(
            {
                "rows": m,
                "xla_s": t_xla,
                "kernel_s": t_kernel,
                "speedup": t_xla / t_kernel,
                "kernel_GBps": 4 * n_weights / t_kernel / 1e9,
                "xla_GBps": 4 * n_weights / t_xla / 1e9,
                "kernel_GFLOPs": 2 * m * n_weights / t_kernel / 1e9,
                "xla_GFLOPs": 2 * m * n_weights / t_xla / 1e9,
                "max_rel_diff": float(jnp.max(jnp.abs(ref - got)) / jnp.max(jnp.abs(ref))),
            }
        )
    return out


def attention_layers(cfg, batch: int = 32, slot_len: int = 192, valid: int = 121) -> dict:
    """12 layers of decode attention over distinct caches, XLA einsums vs the kernel."""
    g, r, k = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    rng = np.random.default_rng(1)
    cache = lambda: jnp.asarray(rng.standard_normal((batch, g, slot_len, k), dtype=np.float32))
    keys = [cache() for _ in range(cfg.n_layers)]
    values = [cache() for _ in range(cfg.n_layers)]
    q = jnp.asarray(rng.standard_normal((batch, 1, g * r, k), dtype=np.float32))
    n_valid = jnp.full((batch,), valid, jnp.int32)
    mask = (jnp.arange(slot_len)[None, :] < n_valid[:, None])[:, None, :]
    xla = jax.jit(lambda q, ks, vs: [decode._attend(q, a, b, mask) for a, b in zip(ks, vs, strict=True)])
    q4 = q[:, 0].reshape(batch, g, r, k)
    attend = lambda q, a, b: cpu_kernels.decode_attention(q, a, b, n_valid)
    kernel = jax.jit(lambda q, ks, vs: [attend(q, a, b) for a, b in zip(ks, vs, strict=True)])
    t_xla = _best(lambda: jax.block_until_ready(xla(q, keys, values)))
    t_kernel = _best(lambda: jax.block_until_ready(kernel(q4, keys, values)))
    read = 2 * cfg.n_layers * batch * g * valid * k * 4
    return {"batch": batch, "valid": valid, "slot_len": slot_len, "xla_s": t_xla, "kernel_s": t_kernel,
            "speedup": t_xla / t_kernel, "kernel_GBps_valid": read / t_kernel / 1e9}  # fmt: skip


def engine_steps(cfg, batches: list[int]) -> list[dict]:
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    params = init_params(cfg, jax.random.key(0), mesh, SAMPLER_RULES)
    out = []
    for b in batches:
        row = {"batch": b}
        for attention, linear in COMBOS:
            eng = bench_engine(cfg, params, mesh, b, 64, 128, 8, attention=attention, linear=linear)
            row[f"{attention}/{linear}"] = min(engine_step_time(eng, 64, 5) for _ in range(2))
            del eng
        out.append(row)
    return out


def main(argv) -> None:
    del argv
    if _MARCH.value:
        os.environ[cpu_kernels.MARCH_ENV] = _MARCH.value
    cfg = presets.llama_100m()
    res = {"kernel_build": cpu_kernels.kernel_info(), "bandwidth_GBps": measure_bandwidth(1.0) / 1e9}
    res["chain"] = matmul_chain(cfg, [int(m) for m in _ROWS.value])
    res["attention"] = attention_layers(cfg)
    res["engine_step_s"] = engine_steps(cfg, [int(b) for b in _BATCHES.value])
    print(json.dumps(res, indent=1))
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(res, f, indent=1)
    print(f"\nkernels built as {res['kernel_build']}, bandwidth {res['bandwidth_GBps']:.1f} GB/s")
    print("matmul chain (12 layers): rows, xla ms, kernel ms, speedup, kernel GB/s, GFLOP/s kernel, xla")
    for c in res["chain"]:
        print(
            f"  {c['rows']:>4} {c['xla_s'] * 1e3:8.2f} {c['kernel_s'] * 1e3:8.2f} {c['speedup']:6.2f}x "
            f"{c['kernel_GBps']:6.1f} {c['kernel_GFLOPs']:6.0f} {c['xla_GFLOPs']:6.0f}"
        )
    a = res["attention"]
    print(
        f"attention (12 layers, batch {a['batch']}, {a['valid']}/{a['slot_len']} valid): xla "
        f"{a['xla_s'] * 1e3:.1f} ms, kernel {a['kernel_s'] * 1e3:.1f} ms ({a['speedup']:.2f}x, "
        f"{a['kernel_GBps_valid']:.1f} GB/s of valid keys and values)"
    )
    for row in res["engine_step_s"]:
        cells = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in row.items() if k != "batch")
        print(f"engine step, batch {row['batch']} (attention/linear, ms): {cells}")


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m benchmarks.bench_kernels`
    run()
