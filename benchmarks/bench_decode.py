"""Decode benchmark of the sampler engine (prints JSON and a table; figures go in docs/history/benchmarks.md).

  JAX_PLATFORMS=cpu python -m benchmarks.bench_decode [--attention auto] [--linear auto] [--sections ...]
      [--paged] [--latency-out FILE] [--json-out FILE] [--quick]
  python -m benchmarks.bench_decode --preset qwen2.5-1.5b --dtype bfloat16 --batches 1,max --hardware h200 \
      --latency-only --json-out decode.json      # an accelerator: tokens/s vs the HBM roofline

Measures, in one run on one device:
  - memory read bandwidth (sum over a 1 GiB array) and the batch-1 decode roofline it implies;
  - decode step time vs batch size (the engine's `generate`, k steps per call) -> `--latency-out` points;
  - decode-path ablation at the largest batch: the decode path without / with fused projections;
  - end-to-end greedy generation (prefill + decode) vs Hugging Face transformers `generate` on the same
    weights (exported with save_hf), batch 1 and the largest batch;
  - static vs continuous batching on a long-tailed (lognormal) length distribution;
  - `auto`: the engine with the requested kernels (default "auto") against the all-XLA engine at batch 1
    and 32, end to end (prefill + 128 tokens) and per decode step, alternating; which kernels "auto" chose
    and the step times it measured to choose;
  - `--paged` (section `paged`): the paged cache against the slotted one: identical greedy tokens and
    logprobs; the most sequences that run at once on a long-tailed length mix in the same KV memory; the
    paged decode step against the bandwidth roofline. On CPU the Pallas kernel runs in interpret mode:
    correctness and capacity only, its speed means nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.decode_timing import bench_engine, engine_step_time, measure_bandwidth, median_time
from jaxrl_async.cli import run_command
from jaxrl_async.model import init_params, presets, save_hf
from jaxrl_async.sampler import Engine, Request, SamplerConfig, SamplerLoop, cpu_kernels
from jaxrl_async.sharding import SAMPLER_RULES, make_mesh


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


def _run_once(eng: Engine, prompts, new_tokens: int) -> tuple[float, list]:
    loop = SamplerLoop(eng)
    for i, p in enumerate(prompts):
        loop.add_request(Request(i, p, max_new_tokens=new_tokens))
    t0 = time.perf_counter()
    out = loop.run()
    return time.perf_counter() - t0, sorted(out, key=lambda c: c.uid)


def engine_end_to_end(eng: Engine, prompts, new_tokens: int) -> tuple[float, list]:
    """Seconds to generate `new_tokens` for every prompt (prefill + decode), after a warm-up pass."""
    _run_once(eng, prompts, new_tokens)
    return _run_once(eng, prompts, new_tokens)


def auto_vs_xla(cfg, params, mesh, prompt_len, new_tokens, k, batches, rounds, **engine_kw) -> dict:
    """The engine with `engine_kw` kernels against the all-XLA engine: end to end (prefill + new_tokens,
    median of `rounds` alternating runs after a warm-up each) and per decode step, at each batch size."""
    rng = np.random.default_rng(2)
    out = {}
    for b in batches:
        prompts = rng.integers(3, cfg.vocab_size, size=(b, prompt_len)).tolist()
        t0 = time.perf_counter()
        engines = {"chosen": bench_engine(cfg, params, mesh, b, prompt_len, new_tokens, k, **engine_kw)}
        build_s = time.perf_counter() - t0
        engines["xla"] = bench_engine(
            cfg, params, mesh, b, prompt_len, new_tokens, k, attention="xla", linear="xla"
        )
        times = {name: [] for name in engines}
        tokens = {}
        for name, eng in engines.items():
            tokens[name] = [c.tokens.tolist() for c in _run_once(eng, prompts, new_tokens)[1]]
        for _ in range(rounds):
            for name, eng in engines.items():
                times[name].append(_run_once(eng, prompts, new_tokens)[0])
        steps = {
            name: min(engine_step_time(e, prompt_len, 5) for _ in range(2)) for name, e in engines.items()
        }
        choice = engines["chosen"].kernel_choice
        e2e = {name: b * new_tokens / float(np.median(t)) for name, t in times.items()}
        out[b] = {
            "chosen_attention": choice.attention,
            "chosen_linear": choice.linear,
            "how": choice.how,
            "reason": choice.reason,
            "timed_step_ms": choice.step_ms,
            "engine_build_s": build_s,
            "end_to_end_tok_s": e2e,
            "end_to_end_ratio": e2e["chosen"] / e2e["xla"],
            "decode_step_ms": {name: 1e3 * t for name, t in steps.items()},
            "decode_ratio": steps["xla"] / steps["chosen"],
            "greedy_sequences_identical": tokens["chosen"] == tokens["xla"],
        }
    return out


def paged_comparison(cfg, params, mesh, quick: bool, bandwidth: float) -> dict:
    """Paged cache vs slotted cache (see the module doc): parity, capacity, decode speed.

    Shapes: `quick` a smoke test; on CPU (Pallas interpret mode) small ones; else prompt 64, 512 new tokens.
    """
    platform = mesh.devices.flat[0].platform
    interpret = platform == "cpu"
    small = quick or interpret
    prompt_len, new_tokens, k = (16, 16, 4) if small else (64, 128, 8)
    res = {"platform": platform, "interpret": interpret}
    # Parity: greedy tokens and logprobs, group samples sharing prompt pages.
    rng = np.random.default_rng(3)
    prompts = [
        rng.integers(3, cfg.vocab_size, size=rng.integers(4, prompt_len + 1)).tolist() for _ in range(6)
    ]
    outs = {}
    for attention in ("xla", "paged_kernel"):
        eng = bench_engine(cfg, params, mesh, 4, prompt_len, new_tokens, k, attention=attention, linear="xla")
        loop = SamplerLoop(eng)
        for i, p in enumerate(prompts):
            loop.add_request(Request(i, p, n_samples=2, max_new_tokens=new_tokens // 2 + i))
        outs[attention] = {(c.uid, c.sample_index): c for c in loop.run()}
    same = [np.array_equal(c.tokens, outs["xla"][key].tokens) for key, c in outs["paged_kernel"].items()]
    diff = max(
        float(np.abs(c.logprobs - outs["xla"][key].logprobs).max()) for key, c in outs["paged_kernel"].items()
    )
    res["parity"] = {"sequences": len(same), "identical": float(np.mean(same)), "max_logprob_diff": diff}
    # Capacity: the same KV memory, a long-tailed mix (p99 / median = 8).
    max_new, n_req, budget_slots = (64, 48, 8) if quick else (256, 256, 8) if interpret else (512, 512, 16)
    median = max_new / 16  # p99 = 8 x median = max_new / 2
    sigma = np.log(8) / 2.326
    lengths = np.clip(np.round(rng.lognormal(np.log(median), sigma, n_req)), 1, max_new).astype(int)
    budget = budget_slots * (prompt_len + max_new)
    cap = {}
    for attention, slots in (("xla", budget_slots), ("paged_kernel", 8 * budget_slots)):
        scfg = SamplerConfig(
            num_slots=slots, max_prompt_len=prompt_len, prompt_buckets=(prompt_len,), max_new_tokens=max_new,
            steps_per_call=k, temperature=1.0, token_budget=budget, attention=attention, linear="xla",
        )  # fmt: skip
        loop = SamplerLoop(Engine(cfg, params, mesh, scfg))
        reqs = iter(
            Request(
                i, rng.integers(3, cfg.vocab_size, size=prompt_len).tolist(), seed=i, max_new_tokens=int(n)
            )
            for i, n in enumerate(lengths)
        )
        t0 = time.perf_counter()
        done = loop.run(lambda reqs=reqs: next(reqs, None))
        st = loop.stats
        cap[attention] = {
            "num_slots": slots,
            "completions": len(done),
            "peak_live": st.peak_live,
            "mean_live": st.tokens_generated / max(st.decode_steps, 1),
            "preemptions": st.preemptions,
            "seconds": time.perf_counter() - t0,
        }
    res["capacity"] = {
        "token_budget": budget,
        "lengths_p50": float(np.percentile(lengths, 50)),
        "lengths_p99": float(np.percentile(lengths, 99)),
        "slotted": cap["xla"],
        "paged": cap["paged_kernel"],
        "peak_ratio": cap["paged_kernel"]["peak_live"] / cap["xla"]["peak_live"],
        "mean_ratio": cap["paged_kernel"]["mean_live"] / cap["xla"]["mean_live"],
    }
    # Decode step of the paged engine with every slot live, against the bandwidth roofline.
    batch = 4 if interpret else 64
    eng = bench_engine(
        cfg, params, mesh, batch, prompt_len, new_tokens, k, attention="paged_kernel", linear="xla"
    )
    step = engine_step_time(eng, prompt_len, 2 if interpret else 5)
    read = decode_bytes(cfg, prompt_len + new_tokens // 2, batch)
    res["decode"] = {
        "batch": batch,
        "step_ms": 1e3 * step,
        "tok_s": batch / step,
        "bytes_per_step": read,
        "fraction_of_bandwidth": read / step / bandwidth,
    }
    return res


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
    t1 = median_time(lambda: gen(1), 2, warmup=0)
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


SECTIONS = ("latency", "ablation", "hf", "batching", "auto", "paged")

_LATENCY_OUT = flags.DEFINE_string("latency-out", None, "write {'points': [{'batch', 'step_s'}, ...]} here")
_JSON_OUT = flags.DEFINE_string("json-out", None, "write the full results here")
_QUICK = flags.DEFINE_bool("quick", False, "tiny model, few reps (a smoke test)")
_SKIP_HF = flags.DEFINE_bool("skip-hf", False, "leave out the section 'hf'")
_SECTIONS = flags.DEFINE_list(
    "sections", ["latency", "ablation", "hf", "batching", "auto"], f"sections to run, of {SECTIONS}"
)
_PAGED = flags.DEFINE_bool("paged", False, "add the section 'paged'")
_PAGED_MODEL = flags.DEFINE_string(
    "paged-model",
    "llama_100m",
    "model preset of the paged section on an accelerator (random weights; on CPU: the tiny model)",
)
_PAGED_DTYPE = flags.DEFINE_string("paged-dtype", "bfloat16", "dtype of the paged section on an accelerator")
_ATTENTION = flags.DEFINE_enum(
    "attention",
    "auto",
    ["auto", "xla", "cpu_kernel", "paged_kernel"],
    "the engine's decode attention (SamplerConfig.attention); section 'auto' compares it with the all-xla "
    "engine",
)
_LINEAR = flags.DEFINE_enum(
    "linear", "auto", ["auto", "xla", "cpu_kernel"], "the engine's decode-step matmuls (SamplerConfig.linear)"
)
_PRESET = flags.DEFINE_string("preset", "", "model shape (default: llama_100m, or tiny with --quick)")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights and compute")
_BATCHES = flags.DEFINE_list(
    "batches", ["1", "2", "4", "8", "16", "32"], "decode batch sizes; 'max' = the largest that fits"
)
_MAX_BATCH = flags.DEFINE_integer("max-batch", 4096, "cap on 'max' (and its value on XLA:CPU)", lower_bound=1)
_PROMPT_LEN = flags.DEFINE_integer("prompt-len", 0, "default 64 (16 with --quick)", lower_bound=0)
_NEW_TOKENS = flags.DEFINE_integer("new-tokens", 0, "default 128 (16 with --quick)", lower_bound=0)
_HARDWARE = flags.DEFINE_string("hardware", "", "a jaxrl_async.perf preset (h100, h200, ...): spec rooflines")
_LATENCY_ONLY = flags.DEFINE_bool(
    "latency-only", False, "only the section 'latency' (the decode latency curve)"
)


def main(argv) -> None:
    del argv
    sections = set(_SECTIONS.value) | ({"paged"} if _PAGED.value else set())
    sections = {"latency"} if _LATENCY_ONLY.value else sections
    sections -= {"hf"} if _SKIP_HF.value else set()
    if sections - set(SECTIONS):
        unknown = sorted(sections - set(SECTIONS))
        raise app.UsageError(f"--sections: unknown {unknown}; choose from {SECTIONS}")
    bad = [b for b in _BATCHES.value if b != "max" and not (b.isdigit() and int(b) > 0)]
    if bad:
        raise app.UsageError(f"--batches: {bad} are neither positive integers nor 'max'")

    quick = _QUICK.value
    name = _PRESET.value or ("tiny" if quick else "llama_100m")
    shape = dict(vocab_size=512, max_seq_len=256) if name == "tiny" else {}
    cfg = presets.get(name, dtype=_DTYPE.value, param_dtype=_DTYPE.value, **shape)
    prompt_len, new_tokens, k, reps = (16, 16, 4, 2) if quick else (64, 128, 8, 5)
    prompt_len, new_tokens = _PROMPT_LEN.value or prompt_len, _NEW_TOKENS.value or new_tokens
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, prompt_len + new_tokens))
    batches = [
        largest_batch(cfg, prompt_len + new_tokens, _MAX_BATCH.value) if b == "max" else int(b)
        for b in _BATCHES.value
    ]
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    params = init_params(cfg, jax.random.key(0), mesh, SAMPLER_RULES)
    platform = mesh.devices.flat[0].platform
    res = {
        "model": name,
        "num_params": cfg.num_params,
        "dtype": cfg.dtype,
        "platform": platform,
        "device_kind": jax.devices()[0].device_kind,
        "devices": len(jax.devices()),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "steps_per_call": k,
        "attention": _ATTENTION.value,
        "linear": _LINEAR.value,
        "sections": sorted(sections),
    }
    if platform == "cpu" and cpu_kernels.compiler_available():
        res["cpu_kernel_build"] = cpu_kernels.kernel_info()
    engine_kw = {"attention": _ATTENTION.value, "linear": _LINEAR.value}
    kernels = _ATTENTION.value != "xla" or _LINEAR.value != "xla"

    bw = measure_bandwidth(0.25 if quick else 1.0)
    ctx = prompt_len + new_tokens // 2
    res["bandwidth_GBps"] = bw / 1e9
    res["roofline_b1_tok_s"] = bw / decode_bytes(cfg, ctx)

    if "latency" in sections:
        points = []
        for b in batches:
            eng = bench_engine(cfg, params, mesh, b, prompt_len, new_tokens, k, **engine_kw)
            points.append({"batch": b, "step_s": engine_step_time(eng, prompt_len, reps)})
            del eng
        hw = None
        if _HARDWARE.value:
            from jaxrl_async.perf.hardware import get_hardware

            hw = get_hardware(_HARDWARE.value)
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
        res["b1_tok_s"] = 1.0 / points[0]["step_s"]
        res["b1_fraction_of_roofline"] = res["b1_tok_s"] / res["roofline_b1_tok_s"]
        if hw is not None:
            res["b1_fraction_of_spec_roofline"] = res["b1_tok_s"] / res["roofline_b1_tok_s_spec"]
        if _LATENCY_OUT.value:
            with open(_LATENCY_OUT.value, "w") as f:
                json.dump({"points": points, "model": res["model"], "steps_per_call": k}, f, indent=1)

    bmax = batches[-1]
    if "ablation" in sections:
        # Side by side, alternating, best of two: the machine may be shared.
        variants = {
            f: bench_engine(cfg, params, mesh, bmax, prompt_len, new_tokens, k, fuse=f, **engine_kw)
            for f in (False, True)
        }
        ablation = {"decode_unfused": [], "decode_fused": []}
        for _ in range(2):
            for fuse, eng in variants.items():
                ablation["decode_fused" if fuse else "decode_unfused"].append(
                    engine_step_time(eng, prompt_len, reps)
                )
        res["ablation_step_s"] = {name: min(ts) for name, ts in ablation.items()}
        del variants

    rng = np.random.default_rng(1)
    if "hf" in sections:
        with tempfile.TemporaryDirectory() as tmp:
            save_hf(cfg, params, tmp)
            res["vs_hf"] = {}
            for b in (1, bmax):
                prompts = rng.integers(3, cfg.vocab_size, size=(b, prompt_len)).tolist()
                eng = bench_engine(cfg, params, mesh, b, prompt_len, new_tokens, k, **engine_kw)
                ours_s, ours = engine_end_to_end(eng, prompts, new_tokens)
                ours_step = engine_step_time(eng, prompt_len, reps)  # measured next to the HF run
                xla_step = ours_step
                if kernels:
                    xla_eng = bench_engine(
                        cfg, params, mesh, b, prompt_len, new_tokens, k, attention="xla", linear="xla"
                    )
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

    if "batching" in sections:
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
    if "auto" in sections:
        res["auto_vs_xla"] = auto_vs_xla(
            cfg, params, mesh, prompt_len, new_tokens, k, (1, bmax), 2 if quick else 3, **engine_kw
        )
    if "paged" in sections:
        if platform == "cpu":  # interpret mode: small shapes
            pcfg = presets.tiny(vocab_size=512, max_seq_len=1024)
        else:
            pcfg = presets.get(_PAGED_MODEL.value, dtype=_PAGED_DTYPE.value, param_dtype=_PAGED_DTYPE.value)
        pparams = params if pcfg == cfg else init_params(pcfg, jax.random.key(0), mesh, SAMPLER_RULES)
        res["paged"] = paged_comparison(pcfg, pparams, mesh, quick, bw)
        res["paged"]["model"] = "tiny" if platform == "cpu" else _PAGED_MODEL.value
    print(json.dumps(res, indent=1))
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(res, f, indent=1)
    _print_table(res)


def _print_table(res: dict) -> None:
    print(
        f"\nmodel {res['model']} ({res['num_params'] / 1e6:.0f}M params, {res['dtype']}) on {res['platform']}"
        f"{', CPU kernels built as ' + res['cpu_kernel_build'] if 'cpu_kernel_build' in res else ''}, "
        f"bandwidth {res['bandwidth_GBps']:.1f} GB/s, roofline b=1 {res['roofline_b1_tok_s']:.1f} tok/s"
    )
    if "latency" in res:
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
    if "ablation_step_s" in res:
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
    if "batching" in res:
        bt = res["batching"]
        print(
            f"batching (lognormal lengths p50 {bt['lengths_p50']:.0f}, p99 {bt['lengths_p99']:.0f}): static "
            f"{bt['static']['tokens_per_s']:.1f} tok/s, continuous {bt['continuous']['tokens_per_s']:.1f} "
            f"tok/s ({bt['continuous_over_static']:.2f}x); without host overlap "
            f"{bt['continuous_no_overlap']['tokens_per_s']:.1f} tok/s "
            f"({bt['continuous_no_overlap_over_static']:.2f}x)"
        )
    for b, r in res.get("auto_vs_xla", {}).items():
        timed = ", ".join(f"{k} {v:.1f}" for k, v in (r["timed_step_ms"] or {}).items())
        e2e, step = r["end_to_end_tok_s"], r["decode_step_ms"]
        print(
            f"{res['attention']}/{res['linear']} vs all-xla, batch {b}: chose {r['chosen_attention']}/"
            f"{r['chosen_linear']} ({r['how']}: {timed or r['reason']}; engine built in "
            f"{r['engine_build_s']:.1f} s); end to end {e2e['chosen']:.1f} vs {e2e['xla']:.1f} tok/s "
            f"({r['end_to_end_ratio']:.2f}x); decode step {step['chosen']:.1f} vs {step['xla']:.1f} ms "
            f"({r['decode_ratio']:.2f}x); identical greedy sequences {r['greedy_sequences_identical']}"
        )
    if "paged" in res:
        pg = res["paged"]
        par, cap, dec = pg["parity"], pg["capacity"], pg["decode"]
        mode = " (Pallas interpret mode: correctness and capacity only)" if pg["interpret"] else ""
        print(f"paged cache, {pg['model']} on {pg['platform']}{mode}:")
        print(
            f"  parity vs slotted: {par['identical']:.2f} of {par['sequences']} greedy sequences identical, "
            f"max |logprob diff| {par['max_logprob_diff']:.1e}"
        )
        print(
            f"  same KV memory ({cap['token_budget']} tokens), lengths p50 {cap['lengths_p50']:.0f} p99 "
            f"{cap['lengths_p99']:.0f}: concurrent sequences peak {cap['paged']['peak_live']} vs "
            f"{cap['slotted']['peak_live']} ({cap['peak_ratio']:.2f}x), mean {cap['paged']['mean_live']:.1f} "
            f"vs {cap['slotted']['mean_live']:.1f} ({cap['mean_ratio']:.2f}x); preemptions "
            f"{cap['paged']['preemptions']}"
        )
        print(
            f"  decode batch {dec['batch']}: {dec['step_ms']:.2f} ms/step, {dec['tok_s']:.0f} tok/s, "
            f"{dec['fraction_of_bandwidth'] * 100:.0f}% of the measured bandwidth"
        )


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m benchmarks.bench_decode`
    run()
