"""Generate completions from a checkpoint with the sampler engine.

  jaxrl-generate --checkpoint DIR (--prompt TEXT | --prompt-ids 1,2,3) --max-new-tokens N \\
      [--temperature T --top-k K --top-p P --seed S --num-samples K --tokenizer DIR|char] \\
      [--step V] [--cpu-kernels]

DIR: a Hugging Face directory (config.json + safetensors), or one of our runs (its workdir, its
checkpoints/ directory or a step in it: the policy weights of that version, newest by default).
Prints each completion as text and as a line `ids: ...` (generated ids only). Temperature 0 = greedy.
`jaxrl-generate` runs the same program.
"""

from __future__ import annotations

import jax
from absl import app, flags

from jaxrl_async.cli import run_command
from jaxrl_async.sampler import Engine, Request, SamplerConfig, SamplerLoop
from jaxrl_async.serving.load import encode_prompt, load_checkpoint, stop_tokens
from jaxrl_async.sharding import make_mesh
from jaxrl_async.tokenizer import load_tokenizer

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Hugging Face directory or a run (see above)")
_PROMPT = flags.DEFINE_string("prompt", None, "prompt text (encoded with the tokenizer)")
_PROMPT_IDS = flags.DEFINE_list("prompt-ids", None, "comma-separated prompt token ids")
_MAX_NEW = flags.DEFINE_integer("max-new-tokens", None, "tokens to generate at most", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy")
_TOP_K = flags.DEFINE_integer("top-k", 0, "keep the k most likely tokens (0 = all)")
_TOP_P = flags.DEFINE_float("top-p", 1.0, "nucleus sampling mass")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_NUM_SAMPLES = flags.DEFINE_integer("num-samples", 1, "completions of the prompt", lower_bound=1)
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "tokenizer directory or 'char' (default: the checkpoint)")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights of HF checkpoints")
_STEP = flags.DEFINE_integer("step", None, "policy version of a run (default: newest)")
_CPU_KERNELS = flags.DEFINE_bool("cpu-kernels", False, "the sampler's C++ attention and matmul kernels (f32)")
flags.mark_flags_as_required(["checkpoint", "max-new-tokens"])
flags.mark_flags_as_mutual_exclusive(["prompt", "prompt-ids"], required=True)


def _tokenizer(path: str, needed: bool):
    """The tokenizer at `path`; with prompt ids (`needed` False) a missing one only costs the text."""
    try:
        return load_tokenizer(path)
    except FileNotFoundError as e:
        if needed:
            raise SystemExit(
                f"--prompt needs a tokenizer: {e} (give --tokenizer DIR|char, or --prompt-ids)"
            ) from None
        print(f"no tokenizer found ({e}): printing token ids only (--tokenizer DIR|char for text)")
        return None


def _prompt_ids(values: list[str]) -> list[int]:
    try:
        ids = [int(t) for t in values if t.strip()]
    except ValueError as e:
        raise app.UsageError(f"--prompt-ids: comma-separated integers, got {','.join(values)!r}") from e
    if not ids:
        raise app.UsageError("--prompt-ids: no ids given")
    return ids


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    prompt_ids = _prompt_ids(_PROMPT_IDS.value) if _PROMPT_IDS.value is not None else None
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    model_cfg, params, tokenizer = load_checkpoint(_CHECKPOINT.value, mesh, _DTYPE.value, _STEP.value)
    tok = _tokenizer(_TOKENIZER.value or tokenizer, needed=prompt_ids is None)
    prompt = encode_prompt(tok, _PROMPT.value) if prompt_ids is None else prompt_ids
    cfg = SamplerConfig(
        num_slots=_NUM_SAMPLES.value,
        max_prompt_len=len(prompt),
        prompt_buckets=(len(prompt),),
        max_new_tokens=_MAX_NEW.value,
        steps_per_call=min(8, _MAX_NEW.value),
        temperature=_TEMPERATURE.value,
        top_k=_TOP_K.value,
        top_p=_TOP_P.value,
        stop_tokens=stop_tokens(tok, model_cfg),
        **({"attention": "cpu_kernel", "linear": "cpu_kernel"} if _CPU_KERNELS.value else {}),
    )
    loop = SamplerLoop(Engine(model_cfg, params, mesh, cfg))
    loop.add_request(Request("cli", prompt, n_samples=_NUM_SAMPLES.value, seed=_SEED.value))
    for c in sorted(loop.run(), key=lambda c: c.sample_index):
        print(
            f"--- sample {c.sample_index} ({c.finish_reason}, {len(c.tokens)} tokens, "
            f"mean logprob {c.logprobs.mean():.3f})"
        )
        if tok is not None:
            print(tok.decode(c.tokens.tolist()))
        print("ids: " + " ".join(str(t) for t in c.tokens.tolist()))


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m jaxrl_async.cli.generate`, as the tests start it
    run()
