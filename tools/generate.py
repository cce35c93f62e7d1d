"""Generate completions from a checkpoint with the sampler engine.

  python tools/generate.py --checkpoint DIR (--prompt TEXT | --prompt-ids 1,2,3) --max-new-tokens N \
      [--temperature T --top-k K --top-p P --seed S --num-samples K --tokenizer DIR|char] \
      [--step V] [--cpu-kernels]

DIR: a Hugging Face directory (config.json + safetensors), or one of our runs (its workdir, its
checkpoints/ directory or a step in it: the policy weights of that version, newest by default).
Prints each completion as text and as a line `ids: ...` (generated ids only). Temperature 0 = greedy.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jaxrl_async.checkpoint import find_checkpoints, load_policy  # noqa: E402
from jaxrl_async.model import load_hf  # noqa: E402
from jaxrl_async.sampler import Engine, Request, SamplerConfig, SamplerLoop  # noqa: E402
from jaxrl_async.sharding import SAMPLER_RULES, make_mesh  # noqa: E402
from jaxrl_async.tokenizer import load_tokenizer  # noqa: E402


def load_checkpoint(path: str, mesh, dtype: str = "float32", step: int | None = None):
    """(ModelConfig, params on `mesh` in the sampler layout, default tokenizer) from a checkpoint.

    Raises:
      FileNotFoundError: `path` is neither a Hugging Face directory nor one of our runs.
    """
    if os.path.exists(os.path.join(path, "config.json")):
        model_cfg, params = load_hf(path, dtype=dtype, mesh=mesh, rules=SAMPLER_RULES, param_dtype=dtype)
        return model_cfg, params, path
    if find_checkpoints(path) is None:
        raise FileNotFoundError(
            f"--checkpoint {path}: neither a Hugging Face directory (config.json) nor a run of ours "
            "(model.json in it, in its checkpoints/ or beside it)"
        )
    model_cfg, params, tokenizer, version = load_policy(path, mesh, SAMPLER_RULES, step)
    print(f"policy version {version} from {find_checkpoints(path)}")
    return model_cfg, params, tokenizer


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


def _parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint directory")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (encoded with the tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-samples", type=int, default=1)
    ap.add_argument(
        "--tokenizer", default=None, help="tokenizer directory or 'char' (default: the checkpoint)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="HF checkpoints")
    ap.add_argument("--step", type=int, default=None, help="policy version of a run (default: newest)")
    ap.add_argument(
        "--cpu-kernels", action="store_true", help="the sampler's C++ attention and matmul kernels (CPU, f32)"
    )
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = _parse_args(argv)
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    model_cfg, params, tokenizer = load_checkpoint(args.checkpoint, mesh, args.dtype, args.step)
    tok = _tokenizer(args.tokenizer or tokenizer, needed=args.prompt is not None)
    if args.prompt is not None:
        prompt = tok.encode(args.prompt)
        char = (args.tokenizer or tokenizer) == "char"
        if tok.bos_id is not None and not char and (not prompt or prompt[0] != tok.bos_id):
            prompt = [tok.bos_id, *prompt]
    else:
        prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    stops = {t for t in (tok and tok.eos_id, model_cfg.eos_token_id) if t is not None}
    cfg = SamplerConfig(
        num_slots=args.num_samples,
        max_prompt_len=len(prompt),
        prompt_buckets=(len(prompt),),
        max_new_tokens=args.max_new_tokens,
        steps_per_call=min(8, args.max_new_tokens),
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop_tokens=tuple(sorted(stops)),
        **({"attention": "cpu_kernel", "linear": "cpu_kernel"} if args.cpu_kernels else {}),
    )
    loop = SamplerLoop(Engine(model_cfg, params, mesh, cfg))
    loop.add_request(Request("cli", prompt, n_samples=args.num_samples, seed=args.seed))
    for c in sorted(loop.run(), key=lambda c: c.sample_index):
        print(
            f"--- sample {c.sample_index} ({c.finish_reason}, {len(c.tokens)} tokens, "
            f"mean logprob {c.logprobs.mean():.3f})"
        )
        if tok is not None:
            print(tok.decode(c.tokens.tolist()))
        print("ids: " + " ".join(str(t) for t in c.tokens.tolist()))


if __name__ == "__main__":
    main()
