"""Serve a checkpoint through JetStream's gRPC API (needs the extra: `pip install -e ".[serve]"`).

  jaxrl-serve --checkpoint DIR [--host localhost --port 9000] [--num-slots 8 --max-prompt-len 256 \\
      --max-new-tokens 256] [--temperature T --top-k K --top-p P --seed S] [--tokenizer DIR|char] \\
      [--step V] [--mesh D,T] [--cpu-kernels]          (or python launch/serve.py ...)

DIR: a Hugging Face directory (config.json + safetensors), or one of our runs (its workdir, its
checkpoints/ directory or a step in it: the policy weights of that version, newest by default), as for
jaxrl-generate. Prints `listening on HOST:PORT` once requests are accepted; SIGINT or SIGTERM stop it.
Clients send JetStream `DecodeRequest`s (text, or token ids) with `max_tokens`; the sampling settings
are the server's. Temperature 0 (the default) = greedy, the same tokens as jaxrl-generate. Logging
follows absl's --verbosity (default: warnings).
"""

from __future__ import annotations

import asyncio
import logging
import os

from absl import app, flags
from absl import logging as absl_logging
from absl.logging import converter

from jaxrl_async.cli import run_command

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Hugging Face directory or a run (see above)")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "tokenizer directory or 'char' (default: the checkpoint)")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights of HF checkpoints")
_STEP = flags.DEFINE_integer("step", None, "policy version of a run (default: newest)")
_HOST = flags.DEFINE_string("host", "localhost", "address to listen on")
_PORT = flags.DEFINE_integer("port", 9000, "port to listen on; 0 picks a free one", lower_bound=0)
_NUM_SLOTS = flags.DEFINE_integer("num-slots", 8, "requests decoded together", lower_bound=1)
_MAX_PROMPT = flags.DEFINE_integer("max-prompt-len", 256, "longest prompt in tokens", lower_bound=1)
_MAX_NEW = flags.DEFINE_integer(
    "max-new-tokens", 256, "most tokens a request generates (its max_tokens caps it further)", lower_bound=1
)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy")
_TOP_K = flags.DEFINE_integer("top-k", 0, "keep the k most likely tokens (0 = all)")
_TOP_P = flags.DEFINE_float("top-p", 1.0, "nucleus sampling mass")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed (each request draws its own stream)")
_MESH = flags.DEFINE_list("mesh", ["1", "1"], "DATA,TENSOR: the engine's devices (slots over DATA)")
_CPU_KERNELS = flags.DEFINE_bool("cpu-kernels", False, "the sampler's C++ attention and matmul kernels (f32)")
flags.mark_flags_as_required(["checkpoint"])


def _mesh_shape(values: list[str]) -> tuple[int, int]:
    try:
        shape = tuple(int(v) for v in values)
    except ValueError:
        shape = ()
    if len(shape) != 2 or min(shape) < 1:
        raise app.UsageError(f"--mesh {','.join(values)}: expected DATA,TENSOR, two positive integers")
    return shape


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    mesh_shape = _mesh_shape(_MESH.value)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # JetStream imports TensorFlow (through seqio)
    try:
        import jetstream.core.orchestrator  # noqa: F401
    except ImportError as e:
        raise SystemExit(f'{e}: serving needs the extra, pip install -e ".[serve]"') from None
    # Importing JetStream's orchestrator sets the root logger to DEBUG, with a handler on stdout (its
    # servicer logs every request at INFO): warnings only, unless --verbosity says otherwise.
    level = converter.absl_to_standard(absl_logging.get_verbosity())
    logging.getLogger().setLevel(level if flags.FLAGS["verbosity"].present else logging.WARNING)
    import jax

    from jaxrl_async.sampler import Engine, SamplerConfig
    from jaxrl_async.serving.driver import EngineDriver
    from jaxrl_async.serving.jetstream_engine import JetStreamEngine
    from jaxrl_async.serving.load import load_checkpoint, stop_tokens
    from jaxrl_async.serving.server import serve
    from jaxrl_async.sharding import make_mesh
    from jaxrl_async.tokenizer import load_tokenizer

    n = mesh_shape[0] * mesh_shape[1]
    if n > len(jax.devices()):
        raise app.UsageError(f"--mesh {mesh_shape}: needs {n} devices, {len(jax.devices())} visible")
    mesh = make_mesh(mesh_shape, ("data", "tensor"), jax.devices()[:n])
    try:
        model_cfg, params, tokenizer = load_checkpoint(_CHECKPOINT.value, mesh, _DTYPE.value, _STEP.value)
    except FileNotFoundError as e:
        raise app.UsageError(str(e)) from None
    tokenizer = _TOKENIZER.value or tokenizer
    try:
        tok = load_tokenizer(tokenizer)
    except FileNotFoundError as e:
        raise app.UsageError(f"the server needs a tokenizer: {e} (give --tokenizer DIR|char)") from None
    kernel = "cpu_kernel" if _CPU_KERNELS.value else "xla"
    cfg = SamplerConfig(
        num_slots=_NUM_SLOTS.value,
        max_prompt_len=_MAX_PROMPT.value,
        max_new_tokens=_MAX_NEW.value,
        steps_per_call=1,  # what JetStreamEngine requires
        temperature=_TEMPERATURE.value,
        top_k=_TOP_K.value,
        top_p=_TOP_P.value,
        stop_tokens=stop_tokens(tok, model_cfg),
        attention=kernel,
        linear=kernel,
    )
    engine = JetStreamEngine(Engine(model_cfg, params, mesh, cfg), tokenizer, seed=_SEED.value)
    del params  # the engine holds the weights in its decode layout
    driver = EngineDriver(engine)
    ready = lambda port: print(f"listening on {_HOST.value}:{port}", flush=True)
    asyncio.run(serve(driver, _HOST.value, _PORT.value, on_ready=ready))


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m jaxrl_async.cli.serve`, as the tests start it
    run()
