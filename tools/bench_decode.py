"""Decode benchmark of the sampler engine (prints JSON and a table; figures go in docs/sampler.md).

  JAX_PLATFORMS=cpu python tools/bench_decode.py [--attention cpu_kernel] [--linear cpu_kernel]
      [--latency-out FILE] [--json-out FILE] [--quick]
  python tools/bench_decode.py --preset qwen2.5-1.5b --dtype bfloat16 --batches 1,max --hardware h200 \
      --latency-only --json-out decode.json      # an accelerator: tokens/s vs the HBM roofline

Measures, in one run on one device:
  - memory read bandwidth (sum over a 1 GiB array) and the batch-1 decode roofline it implies;
  - decode step time vs batch size (the engine's `generate`, k steps per call) -> `--latency-out` points;
  - decode-path ablation at the largest batch: the model's scan `forward` vs the sampler's decode path
    without / with fused projections;
  - end-to-end greedy generation (prefill + decode) vs Hugging Face transformers `generate` on the same
    weights (exported with save_hf), batch 1 and the largest batch;
  - static vs continuous batching on a long-tailed (lognormal) length distribution.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_async.model import forward, init_cache, init_params, presets, save_hf  # noqa: E402
from jaxrl_async.sampler import Engine, Request, SamplerConfig, SamplerLoop  # noqa: E402
from jaxrl_async.sharding import SAMPLER_RULES, make_mesh  # noqa: E402


def _median_time(fn, reps: int, warmup: int = 1) -> float:
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
    t = _median_time(lambda: f(x).block_until_ready(), reps)
    return x.nbytes / t


def decode_bytes(cfg, context: int, batch: int = 1) -> int:
    """Bytes a decode step must read: every weight once (one embedding row) + each row's valid KV."""
    itemsize = jnp.dtype(cfg.param_dtype).itemsize
    weights = cfg.num_params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    kv = 2 * cfg.n_layers * context * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    return weights * itemsize + batch * kv


def decode_flops(cfg, context: int, batch: int) -> float:
    """Matmul FLOPs of a decode step: every weight once per row, attention over the row's context."""
    weights = cfg.num_params - cfg.vocab_size * cfg.d_model * (0 if cfg.tie_embeddings else 1)
    return batch * (2.0 * weights + 4.0 * cfg.n_layers * context * cfg.n_heads * cfg.head_dim)


def largest_batch(cfg, slot_len: int, cap: int, fraction: float = 0.8) -> int:
    """The most slots (a multiple of 8, at most `cap`) whose KV cache and logits fit in `fraction` of
    device 0's memory beside two weight copies (the sampler-layout input and the engine's decode layout).
    `cap` where the device reports no memory size (XLA:CPU)."""
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if not limit:
        return cap
    weights = 2 * cfg.num_params * jnp.dtype(cfg.param_dtype).itemsize
    per_slot = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * slot_len * jnp.dtype(cfg.dtype).itemsize
    per_slot += 4 * cfg.vocab_size * 4  # float32 logits and sampling temporaries per row
    n = int((fraction * limit - weights) // per_slot)
    return max(1, min(cap, n // 8 * 8))


def _engine(cfg, params, mesh, batch, prompt_len, new_tokens, k, fuse=True, **kw):
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


def engine_step_time(eng: Engine, prompt_len: int, reps: int) -> float:
    """Seconds per decode step with every slot live (generate calls of k steps, mid-sequence)."""
    state = eng.init_state()
    prefix = eng.prefill(np.arange(1, prompt_len + 1) % eng.model_cfg.vocab_size)
    for b in range(eng.cfg.num_slots):
        state = eng.insert(state, prefix, b, seed=b, sample_index=0, max_new_tokens=eng.cfg.max_new_tokens)
    box = [state]

    def call():
        box[0], rnd = eng.generate(box[0])
        rnd.tokens.block_until_ready()

    return _median_time(call, reps, warmup=2) / eng.cfg.steps_per_call


def model_forward_step_time(cfg, params, batch: int, cache_len: int, pos: int, reps: int) -> float:
    """Baseline: one decode step through the model's own `forward` (layer scan, stacked cache)."""

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, cache, tok_B, pos_B):
        logits, cache = forward(cfg, params, tok_B[:, None], pos_B[:, None], cache=cache)
        return jnp.argmax(logits[:, 0], -1).astype(jnp.int32), cache

    box = [init_cache(cfg, batch, cache_len)]
    tok, p = jnp.zeros((batch,), jnp.int32), jnp.full((batch,), pos, jnp.int32)

    def call():
        t, box[0] = step(params, box[0], tok, p)
        t.block_until_ready()

    return _median_time(call, reps, warmup=2)


def engine_end_to_end(eng: Engine, prompts, new_tokens: int) -> tuple[float, list]:
    """Seconds to generate `new_tokens` for every prompt (prefill + decode), after a warm-up pass."""
    times, out = [], None
    for _ in range(2):
        loop = SamplerLoop(eng)
        for i, p in enumerate(prompts):
            loop.add_request(Request(i, p, max_new_tokens=new_tokens))
        t0 = time.perf_counter()
        out = loop.run()
        times.append(time.perf_counter() - t0)
    return times[-1], sorted(out, key=lambda c: c.uid)


def hf_generate(path: str, prompts, new_tokens: int, threads: int) -> tuple[float, float, np.ndarray]:
    """(seconds for `new_tokens` greedy tokens, seconds for 1 token (≈ prefill), generated ids).

    torch's OpenMP threads spin: on the shared machine 2 threads ran ~15x slower than 1, so the caller
    tries several thread counts and keeps the fastest.
    """
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(np.asarray(prompts), dtype=torch.long)
    mask = torch.ones_like(ids)

    def gen(n):
        with torch.inference_mode():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    gen(2)
    t1 = _median_time(lambda: gen(1), 2, warmup=0)
    t0 = time.perf_counter()
    out = gen(new_tokens)
    return time.perf_counter() - t0, t1, out[:, ids.shape[1] :].numpy()


def batching_comparison(cfg, params, mesh, slots, n_requests, median, sigma, cap, k, seed=0, **kw) -> dict:
    """Tokens/s of static vs continuous batching (host overlap on and off) on lognormal lengths.

    `kw`: further SamplerConfig fields (the kernels under test)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(median), sigma, n_requests)), 1, cap).astype(int)
    prompts = [rng.integers(3, cfg.vocab_size, size=rng.integers(8, 33)).tolist() for _ in range(n_requests)]
    scfg = SamplerConfig(
        num_slots=slots,
        max_prompt_len=32,
        prompt_buckets=(16, 32),
        max_new_tokens=cap,
        steps_per_call=k,
        temperature=1.0,
        **kw,
    )
    engines = {
        True: Engine(cfg, params, mesh, scfg),
        False: Engine(cfg, params, mesh, dataclasses.replace(scfg, overlap_host=False)),
    }
    out = {
        "lengths_p50": float(np.percentile(lengths, 50)),
        "lengths_p99": float(np.percentile(lengths, 99)),
        "tokens": int(lengths.sum()),
        "slots": slots,
        "requests": n_requests,
        "steps_per_call": k,
    }
    for eng in engines.values():
        warm = SamplerLoop(eng)
        for i in range(slots + 1):
            warm.add_request(Request(i, prompts[i % n_requests][: 8 + 16 * (i % 2)], max_new_tokens=k + 1))
        warm.run()
    runs = (("static", True, True), ("continuous", False, True), ("continuous_no_overlap", False, False))
    for name, static, overlap in runs:
        loop = SamplerLoop(engines[overlap], static_batching=static)
        reqs = [
            Request(i, p, seed=i, max_new_tokens=int(n))
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
        ]
        it = iter(reqs)
        t0 = time.perf_counter()
        done = loop.run(lambda it=it: next(it, None))
        dt = time.perf_counter() - t0
        assert sum(len(c.tokens) for c in done) == lengths.sum()
        out[name] = {
            "seconds": dt,
            "tokens_per_s": lengths.sum() / dt,
            "decode_steps": loop.stats.decode_steps,
            "occupancy": loop.stats.occupancy,
        }
    for name in ("continuous", "continuous_no_overlap"):
        out[name + "_over_static"] = out[name]["tokens_per_s"] / out["static"]["tokens_per_s"]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latency-out", help="write {'points': [{'batch', 'step_s'}, ...]} here")
    ap.add_argument("--json-out", help="write the full results here")
    ap.add_argument("--quick", action="store_true", help="tiny model, few reps (a smoke test)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--attention",
        default="xla",
        choices=("xla", "cpu_kernel"),
        help="the engine's decode attention (SamplerConfig.attention); with a cpu_kernel the transformers "
        "comparison also times the all-xla engine in the same place",
    )
    ap.add_argument(
        "--linear",
        default="xla",
        choices=("xla", "cpu_kernel"),
        help="the engine's decode-step matmuls (SamplerConfig.linear)",
    )
    ap.add_argument("--preset", default="", help="model shape (default: llama_100m, or tiny with --quick)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights and compute")
    ap.add_argument(
        "--batches", default="1,2,4,8,16,32", help="decode batch sizes; 'max' = the largest that fits"
    )
    ap.add_argument("--max-batch", type=int, default=4096, help="cap on 'max' (and its value on XLA:CPU)")
    ap.add_argument("--prompt-len", type=int, default=0, help="default 64 (16 with --quick)")
    ap.add_argument("--new-tokens", type=int, default=0, help="default 128 (16 with --quick)")
    ap.add_argument(
        "--hardware", default="", help="a jaxrl_async.perf preset (h100, h200, ...): spec rooflines"
    )
    ap.add_argument(
        "--latency-only",
        action="store_true",
        help="only the decode latency curve and its rooflines (no ablation, transformers or batching)",
    )
    args = ap.parse_args(argv)

    quick = args.quick
    name = args.preset or ("tiny" if quick else "llama_100m")
    shape = dict(vocab_size=512, max_seq_len=256) if name == "tiny" else {}
    cfg = presets.get(name, dtype=args.dtype, param_dtype=args.dtype, **shape)
    prompt_len, new_tokens, k, reps = (16, 16, 4, 2) if quick else (64, 128, 8, 5)
    prompt_len, new_tokens = args.prompt_len or prompt_len, args.new_tokens or new_tokens
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, prompt_len + new_tokens))
    batches = [
        largest_batch(cfg, prompt_len + new_tokens, args.max_batch) if b == "max" else int(b)
        for b in args.batches.split(",")
    ]
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    params = init_params(cfg, jax.random.key(0), mesh, SAMPLER_RULES)
    res = {
        "model": name,
        "num_params": cfg.num_params,
        "dtype": cfg.dtype,
        "device_kind": jax.devices()[0].device_kind,
        "devices": len(jax.devices()),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "steps_per_call": k,
        "attention": args.attention,
        "linear": args.linear,
    }
    engine_kw = {"attention": args.attention, "linear": args.linear}
    kernels = args.attention != "xla" or args.linear != "xla"

    bw = measure_bandwidth(0.25 if quick else 1.0)
    ctx = prompt_len + new_tokens // 2
    res["bandwidth_GBps"] = bw / 1e9
    res["roofline_b1_tok_s"] = bw / decode_bytes(cfg, ctx)

    points = []
    for b in batches:
        eng = _engine(cfg, params, mesh, b, prompt_len, new_tokens, k, **engine_kw)
        points.append({"batch": b, "step_s": engine_step_time(eng, prompt_len, reps)})
        del eng
    hw = None
    if args.hardware:
        from jaxrl_async.perf.hardware import get_hardware

        hw = get_hardware(args.hardware)
        res["hardware"] = {"name": hw.name, "mem_bw": hw.mem_bw, "peak_flops": hw.peak_flops}
        res["roofline_b1_tok_s_spec"] = hw.mem_bw / decode_bytes(cfg, ctx)
    for p in points:
        b = p["batch"]
        p["tok_s"] = b / p["step_s"]
        p["memory_roofline_tok_s"] = b * bw / decode_bytes(cfg, ctx, b)
        if hw is not None:
            step = max(decode_bytes(cfg, ctx, b) / hw.mem_bw, decode_flops(cfg, ctx, b) / hw.peak_flops)
            p["spec_roofline_tok_s"] = b / step
            p["fraction_of_spec_roofline"] = p["tok_s"] / p["spec_roofline_tok_s"]
    res["latency"] = points
    step1 = points[0]["step_s"]
    res["b1_tok_s"] = 1.0 / step1
    res["b1_fraction_of_roofline"] = res["b1_tok_s"] / res["roofline_b1_tok_s"]
    if hw is not None:
        res["b1_fraction_of_spec_roofline"] = res["b1_tok_s"] / res["roofline_b1_tok_s_spec"]
    if args.latency_out:
        with open(args.latency_out, "w") as f:
            json.dump({"points": points, "model": res["model"], "steps_per_call": k}, f, indent=1)
    if args.latency_only:
        _finish(res, args)
        return

    bmax = batches[-1]
    # Side by side, alternating, best of two: the machine may be shared.
    variants = {
        f: _engine(cfg, params, mesh, bmax, prompt_len, new_tokens, k, fuse=f, **engine_kw)
        for f in (False, True)
    }
    ablation = {"model_forward_scan": [], "decode_unfused": [], "decode_fused": []}
    for _ in range(2):
        ablation["model_forward_scan"].append(
            model_forward_step_time(cfg, params, bmax, prompt_len + new_tokens, ctx, reps)
        )
        for fuse, eng in variants.items():
            ablation["decode_fused" if fuse else "decode_unfused"].append(
                engine_step_time(eng, prompt_len, reps)
            )
    res["ablation_step_s"] = {name: min(ts) for name, ts in ablation.items()}
    del variants

    rng = np.random.default_rng(1)
    if not args.skip_hf:
        with tempfile.TemporaryDirectory() as tmp:
            save_hf(cfg, params, tmp)
            res["vs_hf"] = {}
            for b in (1, bmax):
                prompts = rng.integers(3, cfg.vocab_size, size=(b, prompt_len)).tolist()
                eng = _engine(cfg, params, mesh, b, prompt_len, new_tokens, k, **engine_kw)
                ours_s, ours = engine_end_to_end(eng, prompts, new_tokens)
                ours_step = engine_step_time(eng, prompt_len, reps)  # measured next to the HF run
                xla_step = ours_step
                if kernels:
                    xla_eng = _engine(cfg, params, mesh, b, prompt_len, new_tokens, k)
                    xla_step = engine_step_time(xla_eng, prompt_len, reps)
                    del xla_eng
                hf_runs = {
                    t: hf_generate(tmp, prompts, new_tokens, t) for t in sorted({1, os.cpu_count() or 1})
                }
                best = min(hf_runs, key=lambda t: hf_runs[t][0])
                hf_s, hf_prefill_s, hf_ids = hf_runs[best]
                agree = float(np.mean([np.array_equal(c.tokens, hf_ids[i]) for i, c in enumerate(ours)]))
                hf_decode_step = (hf_s - hf_prefill_s) / (new_tokens - 1)
                res["vs_hf"][b] = {
                    "ours_tok_s": b * new_tokens / ours_s,
                    "hf_tok_s": b * new_tokens / hf_s,
                    "end_to_end_speedup": hf_s / ours_s,
                    "ours_decode_tok_s": b / ours_step,
                    "hf_decode_tok_s": b / hf_decode_step,
                    "decode_speedup": hf_decode_step / ours_step,
                    "xla_engine_decode_tok_s": b / xla_step,
                    "greedy_sequences_identical": agree,
                    "hf_torch_threads": best,
                    "hf_tok_s_by_threads": {t: b * new_tokens / r[0] for t, r in hf_runs.items()},
                }

    res["batching"] = batching_comparison(
        cfg,
        params,
        mesh,
        slots=8 if quick else 16,
        n_requests=24 if quick else 128,
        median=6 if quick else 12,
        sigma=1.0,
        cap=32 if quick else 96,
        k=4,
        **engine_kw,
    )
    _finish(res, args)


def _finish(res: dict, args) -> None:
    print(json.dumps(res, indent=1))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)
    _print_table(res)


def _print_table(res: dict) -> None:
    print(
        f"\nmodel {res['model']} ({res['num_params'] / 1e6:.0f}M params, {res['dtype']}), "
        f"bandwidth {res['bandwidth_GBps']:.1f} GB/s, roofline b=1 {res['roofline_b1_tok_s']:.1f} tok/s"
    )
    print(f"{'batch':>6} {'step ms':>9} {'tok/s':>9}")
    for p in res["latency"]:
        print(f"{p['batch']:>6} {p['step_s'] * 1e3:>9.1f} {p['batch'] / p['step_s']:>9.1f}")
    print(f"batch 1: {res['b1_fraction_of_roofline'] * 100:.0f}% of the measured-bandwidth roofline")
    if "b1_fraction_of_spec_roofline" in res:
        print(
            f"batch 1: {res['b1_fraction_of_spec_roofline'] * 100:.0f}% of {res['hardware']['name']}'s "
            f"HBM roofline; largest batch {res['latency'][-1]['batch']}: "
            f"{res['latency'][-1]['fraction_of_spec_roofline'] * 100:.0f}% of its roofline"
        )
    if "ablation_step_s" not in res:
        return
    print(
        "ablation at the largest batch (ms/step): "
        + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in res["ablation_step_s"].items())
    )
    for b, r in res.get("vs_hf", {}).items():
        print(
            f"vs transformers, batch {b}: end-to-end {r['ours_tok_s']:.1f} vs {r['hf_tok_s']:.1f} tok/s "
            f"({r['end_to_end_speedup']:.2f}x); decode {r['ours_decode_tok_s']:.1f} vs "
            f"{r['hf_decode_tok_s']:.1f} tok/s ({r['decode_speedup']:.2f}x); identical greedy sequences "
            f"{r['greedy_sequences_identical']:.2f}; attention {res['attention']}, linear {res['linear']}"
            + (
                f" (all-xla engine, same place: {r['xla_engine_decode_tok_s']:.1f} tok/s)"
                if "xla" != res["attention"] or "xla" != res["linear"]
                else ""
            )
        )
    bt = res["batching"]
    print(
        f"batching (lognormal lengths p50 {bt['lengths_p50']:.0f}, p99 {bt['lengths_p99']:.0f}): static "
        f"{bt['static']['tokens_per_s']:.1f} tok/s, continuous {bt['continuous']['tokens_per_s']:.1f} tok/s "
        f"({bt['continuous_over_static']:.2f}x); without host overlap "
        f"{bt['continuous_no_overlap']['tokens_per_s']:.1f} tok/s "
        f"({bt['continuous_no_overlap_over_static']:.2f}x)"
    )


if __name__ == "__main__":
    main()
