"""Generate completions from a checkpoint with the sampler engine.

  python tools/generate.py --checkpoint DIR (--prompt TEXT | --prompt-ids 1,2,3) --max-new-tokens N \
      [--temperature T --top-k K --top-p P --seed S --num-samples K --tokenizer DIR|char]

Prints each completion as text and as a line `ids: ...` (generated ids only). Temperature 0 = greedy.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jaxrl_async.model import load_hf  # noqa: E402
from jaxrl_async.sampler import Engine, Request, SamplerConfig, SamplerLoop  # noqa: E402
from jaxrl_async.sharding import SAMPLER_RULES, make_mesh  # noqa: E402
from jaxrl_async.tokenizer import load_tokenizer  # noqa: E402


def load_checkpoint(path: str, mesh, dtype: str = "float32"):
    """(ModelConfig, params on `mesh` in the sampler layout) from a checkpoint directory.

    Only Hugging Face directories (config.json + safetensors) are read today. Hook: the orchestrator's
    orbax checkpoints will be restored here (abstract_params(cfg, mesh, SAMPLER_RULES) as the target).
    """
    if os.path.exists(os.path.join(path, "config.json")):
        return load_hf(path, dtype=dtype, mesh=mesh, rules=SAMPLER_RULES)
    raise NotImplementedError(
        f"{path}: no config.json; only Hugging Face checkpoint directories are supported"
    )


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
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = _parse_args(argv)
    tok = load_tokenizer(args.tokenizer or args.checkpoint)
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    model_cfg, params = load_checkpoint(args.checkpoint, mesh, args.dtype)
    if args.prompt is not None:
        prompt = tok.encode(args.prompt)
        if tok.bos_id is not None and args.tokenizer != "char" and (not prompt or prompt[0] != tok.bos_id):
            prompt = [tok.bos_id, *prompt]
    else:
        prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    stops = {t for t in (tok.eos_id, model_cfg.eos_token_id) if t is not None}
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
    )
    loop = SamplerLoop(Engine(model_cfg, params, mesh, cfg))
    loop.add_request(Request("cli", prompt, n_samples=args.num_samples, seed=args.seed))
    for c in sorted(loop.run(), key=lambda c: c.sample_index):
        print(
            f"--- sample {c.sample_index} ({c.finish_reason}, {len(c.tokens)} tokens, "
            f"mean logprob {c.logprobs.mean():.3f})"
        )
        print(tok.decode(c.tokens.tolist()))
        print("ids: " + " ".join(str(t) for t in c.tokens.tolist()))


if __name__ == "__main__":
    main()
