"""The stages of benchmarks/device_check.sh that no benchmark tool covers; each writes its JSON as it goes.

  python -m benchmarks.device_probe --stage env --json-out env.json
  python -m benchmarks.device_probe --stage decode --preset qwen3-8b --hardware h200 --json-out d.json
  python -m benchmarks.device_probe --stage attention --json-out attention.json
  python -m benchmarks.device_probe --stage train_memory --preset qwen2.5-1.5b --json-out tm.json

Stages:
  env           versions (Python, jax, jaxlib, the accelerator plugins), devices and their memory, and an
                import of every package the project needs (which ones are missing).
  decode        the sampler engine's decode step with random weights (`--preset`, bf16) at each
                `--points` batch x context, in that order (the bars' first), each in a process of its own
                under `--point-limit-s`, within `--stage-limit-s`; a point whose weights and KV cache the
                plan says will not fit `--hardware` is skipped, saying so: tokens/s against the HBM
                roofline (`bench_decode.decode_bytes` / `decode_flops`), and the host gap: seconds per call
                when each call's tokens are read before the next is dispatched, minus those of calls
                dispatched back to back (what a loop that blocks on every call leaves the device idle).
  attention     packed-row training attention (`--attention`, default the run's "auto") forward and
                backward at `--seq-len` with the 8B head shape, against `blocked` on the same inputs:
                seconds, the largest gradient difference at real positions (the loss weighs no padding),
                and the device's peak bytes.
  train_memory  the train step at `--rows` x `--budget` (remat, bf16 compute, fp32 masters): the device
                compiler's memory analysis, the peak bytes in use after one real step, and the plan
                check's figure for the same shape (compiled on CPU in a subprocess, as jaxrl-plan-check
                does).

Flags are parsed with argparse, not absl: a stage imports benchmark modules (bench_decode, bench_train)
whose absl flags share names with these. The JSON file is rewritten after every measured point, so a
stage killed by its time limit keeps what it measured; `"done": true` marks a stage that finished.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_async.cli import command_env, module_command


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="device_probe", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--stage", required=True, choices=["env", "decode", "decode_point", "attention", "train_memory"]
    )
    ap.add_argument("--json-out", default=None, help="the stage's JSON (rewritten after every point)")
    ap.add_argument("--preset", default="qwen3-8b", help="model shape (random weights)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights, compute")
    ap.add_argument("--hardware", default="", help="a jaxrl_async.perf preset: the roofline (decode)")
    ap.add_argument(
        "--points", default="1x1024,64x8192,64x1024,1x8192",
        help="decode: batch x context (the prompt) points, in the order they run (the bars' first)",
    )  # fmt: skip
    ap.add_argument("--point-limit-s", type=float, default=0, help="decode: one point's limit, s")
    ap.add_argument("--stage-limit-s", type=float, default=0, help="decode: the stage's seconds; 0 = any")
    ap.add_argument("--new-tokens", type=int, default=64, help="decode positions past the prompt")
    ap.add_argument("--steps-per-call", type=int, default=16, help="decode steps per generate call")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (medians reported)")
    ap.add_argument("--seq-len", type=int, default=32768, help="attention: positions per packed row")
    ap.add_argument("--attention", default="auto", help="attention: the implementation under test")
    ap.add_argument("--rows", type=int, default=1, help="train_memory: rows per micro-batch")
    ap.add_argument("--budget", type=int, default=32768, help="train_memory: positions per row")
    ap.add_argument("--plan-figure", action="store_true", help="train_memory: print the plan check's peak")
    ap.add_argument(
        "--plan-target", default="cpu", choices=["cpu", "gpu", "tpu"], help="--plan-figure's target"
    )
    return ap


# What the project imports (module names), beside jax: the env stage reports the missing ones.
PACKAGES = (
    "flax",
    "optax",
    "orbax.checkpoint",
    "grain",
    "array_record",
    "ml_collections",
    "tensorboard",
    "tensorboardX",
    "safetensors",
    "tokenizers",
    "numpy",
    "absl",
    "math_verify",
    "latex2sympy2_extended",
    "antlr4",
    "sympy",
    "zmq",
    "pyarrow",
    "jinja2",
)


class Record:
    """A stage's JSON, written to `path` on every `put`."""

    def __init__(self, path: str | None, **fields):
        self.path, self.data = path, {"done": False, **fields}

    def put(self, **fields) -> None:
        self.data.update(fields)
        if self.path:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1)
            os.replace(tmp, self.path)  # a reader (or a kill) never sees half a file


def _peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def stage_env(rec: Record, args) -> None:
    from importlib import metadata

    versions = {}
    for dist in (
        "jax",
        "jaxlib",
        "jax-cuda12-plugin",
        "jax-cuda13-plugin",
        "jax-cuda12-pjrt",
        "jax-cuda13-pjrt",
        "libtpu",
        "flax",
        "optax",
        "orbax-checkpoint",
        "grain",
        "numpy",
    ):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    rec.put(python=platform.python_version(), versions=versions)
    missing = {}
    for name in PACKAGES:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any failure to import is what this stage reports
            missing[name] = f"{type(e).__name__}: {e}"
    rec.put(missing=missing)
    import jaxrl_async.runtime.orchestrator  # noqa: F401 - the whole runtime imports

    devices = [
        {
            "kind": d.device_kind,
            "platform": d.platform,
            "bytes_limit": (d.memory_stats() or {}).get("bytes_limit"),
        }
        for d in jax.devices()
    ]
    rec.put(
        backend=jax.default_backend(),
        devices=devices,
        mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
    )
    if missing:
        raise SystemExit(f"missing packages: {sorted(missing)}")


def _decode_point(eng, prompt_len: int, reps: int) -> dict:
    """Seconds per call, read every call vs dispatched back to back, and the host's dispatch time."""
    from benchmarks.decode_timing import fill_slots

    state, extra = fill_slots(eng, prompt_len)
    for _ in range(2):  # compile and warm up
        state, rnd = eng.generate(state, *extra)
        rnd.tokens.block_until_ready()
    blocked, piped, dispatch = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        state, rnd = eng.generate(state, *extra)
        dispatch.append(time.perf_counter() - t0)
        rnd.tokens.block_until_ready()
        blocked.append(time.perf_counter() - t0)
        n = 4
        t0 = time.perf_counter()
        for _ in range(n):
            state, rnd = eng.generate(state, *extra)
        rnd.tokens.block_until_ready()
        piped.append((time.perf_counter() - t0) / n)
    call_s, piped_s = float(np.median(blocked)), float(np.median(piped))
    return {
        "call_s": call_s,
        "pipelined_call_s": piped_s,
        "dispatch_s": float(np.median(dispatch)),
        "host_gap_s": max(call_s - piped_s, 0.0),
    }


def _points(spec: str) -> list[tuple[int, int]]:
    try:
        return [(int(b), int(c)) for b, c in (p.split("x") for p in spec.split(","))]
    except ValueError:
        raise SystemExit(f"--points {spec!r}: expected BATCHxCONTEXT,... (e.g. 1x1024,64x8192)") from None


def _decode_model(args, contexts: list[int]):
    from jaxrl_async.model import presets

    shape = dict(vocab_size=512) if args.preset == "tiny" else {}
    cfg = presets.get(args.preset, dtype=args.dtype, param_dtype=args.dtype, **shape)
    return cfg.replace(max_seq_len=max(cfg.max_seq_len, max(contexts) + args.new_tokens))


def decode_fit(cfg, batch: int, context: int, new_tokens: int, hw) -> str | None:
    """Why a decode point will not fit one device of `hw` (None: it fits, or no hardware named): its weights
    and KV cache (`runtime.plan_check`'s analytic counts) against the memory JAX may use there."""
    from jaxrl_async.runtime.plan_check import (
        kv_cache_bytes,
        mem_fraction,
        sampler_weight_bytes,
        target_platform,
    )

    if hw is None:
        return None
    itemsize = jnp.dtype(cfg.dtype).itemsize
    kv = kv_cache_bytes(cfg, batch, context + new_tokens, (1, 1), itemsize)
    need = sampler_weight_bytes(cfg, (1, 1), itemsize) + kv
    fraction, source = mem_fraction(target_platform(hw.name), dict(os.environ))
    usable = hw.mem_bytes * fraction
    if need <= usable:
        return None
    return (f"weights + KV cache {need / 2**30:.1f} GiB > {usable / 2**30:.1f} GiB usable on {hw.name} "
            f"({hw.mem_bytes / 2**30:.0f} GiB x {fraction:.2f} from {source})")  # fmt: skip


def stage_decode(rec: Record, args) -> None:
    """Each point in a process of its own under its own limit (`--stage decode_point`), in `--points`
    order; a point the plan says will not fit is skipped, and so is one that the stage's remaining time
    cannot hold, each saying why."""
    from jaxrl_async.perf.hardware import get_hardware

    hw = get_hardware(args.hardware) if args.hardware else None
    points = _points(args.points)
    cfg = _decode_model(args, [c for _, c in points])
    rec.put(
        model=args.preset, num_params=cfg.num_params, dtype=args.dtype, steps_per_call=args.steps_per_call,
        hardware=hw and {"name": hw.name, "mem_bw": hw.mem_bw, "peak_flops": hw.peak_flops},
        order=[f"{b}x{c}" for b, c in points], points=[], skipped=[],
    )  # fmt: skip
    t_start = time.perf_counter()
    for b, ctx in points:
        why = decode_fit(cfg, b, ctx, args.new_tokens, hw)
        limit = args.point_limit_s or None
        if args.stage_limit_s:
            left = args.stage_limit_s - (time.perf_counter() - t_start) - 5  # 5 s to write and exit
            limit = min(limit or left, left)
            if why is None and limit < 10:
                why = f"{left:.0f} s left of the stage's {args.stage_limit_s:.0f} s"
        if why is not None:
            print(f"decode {b}x{ctx}: skipped: {why}", flush=True)
            rec.put(skipped=[*rec.data["skipped"], {"batch": b, "context": ctx, "why": why}])
            continue
        cmd = module_command("benchmarks.device_probe", *_point_argv(args, f"{b}x{ctx}"))
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            why = f"timed out after its limit of {limit:.0f} s"
            print(f"decode {b}x{ctx}: {why}", flush=True)
            rec.put(skipped=[*rec.data["skipped"], {"batch": b, "context": ctx, "why": why}])
            continue
        if out.returncode != 0:
            raise SystemExit(f"decode point {b}x{ctx} failed:\n{out.stderr[-3000:]}")
        p = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"decode {b}x{ctx}: {p['tok_s']:.1f} tok/s", flush=True)
        rec.put(points=[*rec.data["points"], p])


def _point_argv(args, point: str) -> list[str]:
    """The arguments of one decode point in a child process (`--stage decode_point`, which prints it)."""
    out = ["--stage", "decode_point", "--points", point, "--preset", args.preset, "--dtype", args.dtype,
           "--new-tokens", str(args.new_tokens), "--steps-per-call", str(args.steps_per_call),
           "--reps", str(args.reps)]  # fmt: skip
    return out + (["--hardware", args.hardware] if args.hardware else [])


def stage_decode_point(args) -> dict:
    """One decode point (`--points` holds one), measured in this process; returns its JSON."""
    from benchmarks.bench_decode import decode_bytes, decode_flops
    from benchmarks.decode_timing import bench_engine
    from jaxrl_async.model import init_params
    from jaxrl_async.perf.hardware import get_hardware
    from jaxrl_async.sharding import SAMPLER_RULES, make_mesh

    hw = get_hardware(args.hardware) if args.hardware else None
    ((b, ctx),) = _points(args.points)
    new, k = args.new_tokens, args.steps_per_call
    cfg = _decode_model(args, [ctx])
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    params = init_params(cfg, jax.random.key(0), mesh, SAMPLER_RULES)
    attention = "paged_kernel" if jax.default_backend() == "gpu" else "auto"
    eng = bench_engine(cfg, params, mesh, b, ctx, new, k, attention=attention)
    p = {"batch": b, "context": ctx, "attention": attention, **_decode_point(eng, ctx, args.reps)}
    if eng.paged:  # the paged kernel's blocking: page-table columns, k_splits, pages per block
        lay = eng.spec.cache.layout
        p["table_width"], (p["k_splits"], p["pages_per_block"]) = lay.width, lay.blocks
    p["step_s"] = p["pipelined_call_s"] / k
    p["tok_s"] = b / p["step_s"]
    mid = ctx + new // 2
    if hw is not None:
        floor = max(decode_bytes(cfg, mid, b) / hw.mem_bw, decode_flops(cfg, mid, b) / hw.peak_flops)
        p["roofline_step_s"] = floor
        p["fraction_of_roofline"] = floor / p["step_s"]
    return p


def _packed_row(t: int, rng) -> np.ndarray:
    """[1, t] segment ids: a long-tailed mix of sequences, then a padding tail."""
    seg, start, sid = np.zeros((1, t), np.int32), 0, 1
    while start < t * 0.97:
        n = min(int(rng.lognormal(np.log(t / 12), 1.0)) + 16, t - start)
        seg[0, start : start + n] = sid
        start, sid = start + n, sid + 1
    return seg


# The attention stage's agreement check: the largest gradient difference from the blocked path, over the
# largest blocked gradient, both at real positions. bf16 rounding stays far below it; wrong masking or
# offsets do not.
ATTENTION_GRAD_TOLERANCE = 0.1


def attention_loss(name: str, seg, w, platform: str | None = None):
    """Jitted (loss, grads wrt q, k, v) of `name` on a packed row: the outputs weighted by `w` at real
    positions only. Padding outputs are never used by a run (the trainer's loss masks them), and
    implementations differ there by design (the blocked path's padding attends to itself, cuDNN's writes
    nothing); weighting them would make a right kernel disagree and could hide a wrong one."""
    from jaxrl_async.model import attention

    w_real = jnp.where((seg != 0)[:, :, None, None], w, 0)

    def loss(q, k, v):
        out = attention.attend(name, q, k, v, seg, platform=platform)
        return jnp.sum(out.astype(jnp.float32) * w_real.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def compare_attention(out, ref, seg) -> dict:
    """`out` against the blocked path's `ref` ((loss, (dq, dk, dv)) each) at the real positions of `seg`:
    the largest gradient difference, relative to the largest blocked gradient, and whether it agrees.
    Finiteness covers every position, padding included: a kernel that leaves memory unwritten shows."""
    (lo, go), (lb, gb) = out, ref
    real = (seg != 0)[:, :, None, None]
    at_real = lambda x: jnp.where(real, x.astype(jnp.float32), 0)
    diff = max(float(jnp.max(jnp.abs(at_real(a) - at_real(b)))) for a, b in zip(go, gb, strict=True))
    scale = max(float(jnp.max(jnp.abs(at_real(b)))) for b in gb)
    res = {"max_grad_diff": diff, "max_grad_rel_diff": diff / max(scale, 1e-30)}
    res["loss"], res["loss_blocked"] = float(lo), float(lb)
    res["finite"] = bool(np.isfinite(float(lo)) and all(bool(jnp.isfinite(a).all()) for a in go))
    res["agrees"] = res["finite"] and res["max_grad_rel_diff"] <= ATTENTION_GRAD_TOLERANCE
    return res


def stage_attention(rec: Record, args) -> None:
    from jaxrl_async.model import attention, presets

    cfg = presets.get(args.preset)
    t, h, g, kd = args.seq_len, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    rng = np.random.default_rng(0)
    dt = jnp.dtype(args.dtype)
    q = jnp.asarray(rng.standard_normal((1, t, h, kd)), dt)
    k, v = (jnp.asarray(rng.standard_normal((1, t, g, kd)), dt) for _ in range(2))
    w = jnp.asarray(rng.standard_normal((1, t, h, kd)), dt)
    impl = attention.resolve(args.attention)
    rec.put(impl=impl, seq_len=t, heads=h, kv_heads=g, head_dim=kd, dtype=args.dtype, layouts={})
    for layout, seg in (("one segment", np.ones((1, t), np.int32)), ("packed", _packed_row(t, rng))):
        seg = jnp.asarray(seg)
        res = {"segments": int(np.max(np.asarray(seg))), "real_positions": int(np.sum(np.asarray(seg) != 0))}
        outs = {}
        for name in (impl, "blocked"):
            fn = attention_loss(name, seg, w)
            jax.block_until_ready(fn(q, k, v))
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                outs[name] = jax.block_until_ready(fn(q, k, v))
                times.append(time.perf_counter() - t0)
            res[f"{name}_fwd_bwd_s"] = float(np.median(times))
            res["peak_bytes_in_use"] = _peak_bytes()
            rec.put(layouts={**rec.data["layouts"], layout: res})
        res.update(compare_attention(outs[impl], outs["blocked"], seg))
        rec.put(layouts={**rec.data["layouts"], layout: res})


def _train_cfg(args):
    from jaxrl_async.model import presets
    from jaxrl_async.trainer import TrainConfig

    model = presets.get(args.preset, dtype="bfloat16", param_dtype="float32")
    cfg = TrainConfig(
        lr=1e-5,
        token_budget=args.budget,
        rows_per_micro=args.rows,
        remat=True,
        minibatches=1,
        compute_dtype="bfloat16",
        logits_chunk=min(4096, args.budget),
    )
    return cfg, model


def stage_train_memory(rec: Record, args) -> None:
    from benchmarks.bench_train import uniform_rollouts
    from jaxrl_async.model import attention, init_params
    from jaxrl_async.runtime.plan_check import compiled_memory
    from jaxrl_async.sharding import make_mesh
    from jaxrl_async.trainer import compute_advantages, create_train_state, pack_rollouts, train_step
    from jaxrl_async.trainer.train_step import compile_abstract

    cfg, model = _train_cfg(args)
    rec.put(model=args.preset, rows=cfg.rows_per_micro, budget=cfg.token_budget)
    # The plan check's figure: the same programs compiled on one CPU device in a fresh process.
    args = [
        "--stage",
        "train_memory",
        "--plan-figure",
        "--plan-target",
        jax.default_backend(),
        "--preset",
        args.preset,
        "--rows",
        str(args.rows),
        "--budget",
        str(args.budget),
    ]
    env = command_env(force_cpu=True)
    cmd = module_command("benchmarks.device_probe", *args)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"plan check figure failed: {out.stderr[-2000:]}")
    rec.put(plan_check_peak_bytes=int(out.stdout.strip().splitlines()[-1]))
    # The same programs compiled by this device's own compiler, with the attention the run uses.
    programs = compile_abstract(cfg, model, make_mesh((1, 1), ("fsdp", "tensor"), jax.devices()[:1]))
    acc, upd = compiled_memory(programs["accumulate"]), compiled_memory(programs["apply"])
    peak = max(acc["peak_estimate"] + programs["optimizer_state_bytes"], upd["peak_estimate"])
    rec.put(compiled_here_peak_bytes=peak, attention=attention.resolve(model.attention))
    del programs
    params = init_params(model, jax.random.key(0))
    rollouts = uniform_rollouts(cfg.rows_per_micro, cfg.token_budget, model.vocab_size, seed=0)
    adv = compute_advantages(cfg.advantage, [r.reward for r in rollouts], [r.group_id for r in rollouts])
    batch = pack_rollouts(rollouts, adv, cfg.token_budget, cfg.rows_per_micro)
    state = create_train_state(cfg, model, params)
    del params
    t0 = time.perf_counter()
    state, m = train_step(state, batch)
    jax.block_until_ready((state.params, m))
    rec.put(first_step_s=time.perf_counter() - t0, peak_bytes_in_use=_peak_bytes())


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.plan_figure:  # on CPU, for the target named by --plan-target
        from jaxrl_async.runtime.plan_check import train_memory

        cfg, model = _train_cfg(args)
        print(train_memory(cfg, model, (1, 1), jax.devices()[:1], args.plan_target)["peak_estimate"])
        return 0
    if args.stage == "decode_point":  # a child of the decode stage: one point, printed as one JSON line
        print(json.dumps(stage_decode_point(args)))
        return 0
    rec = Record(args.json_out, stage=args.stage, backend=jax.default_backend())
    t0 = time.perf_counter()
    stages = {"env": stage_env, "decode": stage_decode, "attention": stage_attention}
    stages["train_memory"] = stage_train_memory
    stages[args.stage](rec, args)
    rec.put(done=True, seconds=time.perf_counter() - t0)
    print(json.dumps(rec.data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
