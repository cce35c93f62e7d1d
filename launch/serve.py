"""Serve a checkpoint through JetStream's gRPC API (needs the extra: `pip install -e ".[serve]"`).

  python launch/serve.py --checkpoint DIR [--host localhost --port 9000] [--num-slots 8 \
      --max-prompt-len 256 --max-new-tokens 256] [--temperature T --top-k K --top-p P --seed S] \
      [--tokenizer DIR|char] [--step V] [--mesh D,T] [--cpu-kernels]

DIR: a Hugging Face directory (config.json + safetensors), or one of our runs (its workdir, its
checkpoints/ directory or a step in it: the policy weights of that version, newest by default), as for
tools/generate.py. Prints `listening on HOST:PORT` once requests are accepted; SIGINT or SIGTERM stop it.
Clients send JetStream `DecodeRequest`s (text, or token ids) with `max_tokens`; the sampling settings
are the server's. Temperature 0 (the default) = greedy, the same tokens as tools/generate.py.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="Hugging Face directory or one of our runs")
    ap.add_argument(
        "--tokenizer", default=None, help="tokenizer directory or 'char' (default: the checkpoint)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="HF checkpoints")
    ap.add_argument("--step", type=int, default=None, help="policy version of a run (default: newest)")
    ap.add_argument("--host", default="localhost", help="address to listen on")
    ap.add_argument("--port", type=int, default=9000, help="0 picks a free port")
    ap.add_argument("--num-slots", type=int, default=8, help="requests decoded together")
    ap.add_argument("--max-prompt-len", type=int, default=256, help="longest prompt in tokens")
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="most tokens a request generates (its max_tokens caps it)",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mesh", default="1,1", help="DATA,TENSOR: the engine's devices (slots over DATA)")
    ap.add_argument(
        "--cpu-kernels", action="store_true", help="the sampler's C++ attention and matmul kernels (CPU, f32)"
    )
    ap.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    args = ap.parse_args(argv)
    try:
        mesh = tuple(int(x) for x in args.mesh.split(","))
        if len(mesh) != 2 or min(mesh) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--mesh {args.mesh}: expected DATA,TENSOR, two positive integers")
    args.mesh = mesh
    return args


def main(argv=None) -> None:
    args = _parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # JetStream imports TensorFlow (through seqio)
    try:
        import jetstream.core.orchestrator  # noqa: F401
    except ImportError as e:
        raise SystemExit(f'{e}: serving needs the extra, pip install -e ".[serve]"') from None
    # Importing JetStream's orchestrator sets the root logger to DEBUG, with a handler on stdout.
    logging.getLogger().setLevel(args.log_level.upper())
    import jax

    from jaxrl_async.sampler import Engine, SamplerConfig
    from jaxrl_async.serving.driver import EngineDriver
    from jaxrl_async.serving.jetstream_engine import JetStreamEngine
    from jaxrl_async.serving.load import load_checkpoint, stop_tokens
    from jaxrl_async.serving.server import serve
    from jaxrl_async.sharding import make_mesh
    from jaxrl_async.tokenizer import load_tokenizer

    n = args.mesh[0] * args.mesh[1]
    if n > len(jax.devices()):
        raise SystemExit(f"--mesh {args.mesh}: needs {n} devices, {len(jax.devices())} visible")
    mesh = make_mesh(args.mesh, ("data", "tensor"), jax.devices()[:n])
    try:
        model_cfg, params, tokenizer = load_checkpoint(args.checkpoint, mesh, args.dtype, args.step)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    tokenizer = args.tokenizer or tokenizer
    try:
        tok = load_tokenizer(tokenizer)
    except FileNotFoundError as e:
        raise SystemExit(f"the server needs a tokenizer: {e} (give --tokenizer DIR|char)") from None
    cfg = SamplerConfig(
        num_slots=args.num_slots,
        max_prompt_len=args.max_prompt_len,
        max_new_tokens=args.max_new_tokens,
        steps_per_call=1,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop_tokens=stop_tokens(tok, model_cfg),
        attention="cpu_kernel" if args.cpu_kernels else "xla",
        linear="cpu_kernel" if args.cpu_kernels else "xla",
    )
    engine = JetStreamEngine(Engine(model_cfg, params, mesh, cfg), tokenizer, seed=args.seed)
    del params  # the engine holds the weights in its decode layout
    driver = EngineDriver(engine)
    ready = lambda port: print(f"listening on {args.host}:{port}", flush=True)
    asyncio.run(serve(driver, args.host, args.port, on_ready=ready))


if __name__ == "__main__":
    main()
