"""Export a run's checkpoint as a Hugging Face directory (config.json + safetensors + tokenizer files).

  python tools/export_hf.py WORKDIR [--step V] --out DIR

WORKDIR: a run's workdir, its checkpoints/ directory or one step in it (default: the newest version).
The result loads with `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and serves with vLLM or
SGLang. Runs with the built-in "char" tokenizer have no Hugging Face tokenizer to copy: the export then
holds the model only, and says so.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workdir", help="a run's workdir, its checkpoints/ or a step directory in it")
    p.add_argument("--step", type=int, default=None, help="the policy version (default: the newest)")
    p.add_argument("--out", required=True, help="the Hugging Face directory to write")
    args = p.parse_args(argv)

    import jax

    from jaxrl_async.checkpoint import load_policy
    from jaxrl_async.model import save_hf
    from jaxrl_async.sharding import SAMPLER_RULES, make_mesh

    mesh = make_mesh((1, 1), ("data", "tensor"), jax.local_devices()[:1])
    try:
        model_cfg, params, tokenizer, version = load_policy(args.workdir, mesh, SAMPLER_RULES, args.step)
    except FileNotFoundError as e:
        p.error(str(e))
    tok_dir = tokenizer if tokenizer != "char" and os.path.isdir(tokenizer) else None
    save_hf(model_cfg, params, args.out, tokenizer_dir=tok_dir)
    print(f"policy version {version} -> {args.out}")
    if tok_dir is None:
        why = f"the run used {tokenizer!r}"
        print(f"no Hugging Face tokenizer to copy ({why}): the export holds the model only")


if __name__ == "__main__":
    main()
