"""Tunix (0.1.7) on the benchmark's spec: the step-0 held-out greedy evaluation with its vanilla sampler.

  python tunix_grpo.py SPEC.json RESULT.json --step0

Runs in the Tunix venv that tools/bench_peers.py builds. What Tunix needs to match transformers' logits on
our export, each listed in the result's "patches":
  - its Llama-3 attention calls `apply_rope` without the config's rope_theta (always its default 1e6):
    the driver wraps the module's `apply_rope` to pass the exported rope_theta (a patch of Tunix, in this
    process only);
  - its KV-cache update fails on jax's default explicit mesh axes: the mesh is built with AxisType.Auto;
  - its sampler prepends BOS when the tokenizer reports one: the tokenizer is loaded with bos_token=None
    (our prompts carry no BOS).
Training with `GRPOLearner` is not implemented in this driver yet: without --step0 it exits with an error
saying so, and the benchmark reports nothing for Tunix it did not measure.
"""

from __future__ import annotations

import functools
import json
import os
import sys

# common.py lies beside this copy: a script's own directory is on its sys.path.
from common import Clock, load_spec, read_jsonl, reward, write_result

PATCHES = [
    "llama3.model.apply_rope wrapped to use the exported rope_theta (Tunix always uses 1e6)",
    "mesh axes AxisType.Auto (the KV-cache update fails on explicit axes)",
    "tokenizer loaded with bos_token=None (the sampler prepends BOS when the tokenizer has one)",
]


def load_model(model_dir: str):
    """Tunix's Llama3 on our export, on a one-device mesh with Auto axes, rope_theta patched in."""
    import jax
    import jax.numpy as jnp
    from tunix.models.llama3 import model as model_lib
    from tunix.models.llama3 import params as params_lib

    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    theta = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    cfg = model_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=theta, norm_eps=hf["rms_norm_eps"],
        weight_tying=bool(hf.get("tie_word_embeddings", False)),
    )  # fmt: skip
    model_lib.apply_rope = functools.partial(model_lib.apply_rope, rope_theta=theta)
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=auto, devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        model = params_lib.create_model_from_safe_tensors(model_dir, cfg, mesh, dtype=jnp.float32)
    return model, cfg, mesh


def greedy_accuracy(sampler, rows: list[dict], spec: dict) -> float:
    """Held-out greedy exact match, prompts grouped by length (no padding)."""
    by_len: dict[int, list[dict]] = {}
    for r in rows:
        by_len.setdefault(len(r["prompt_ids"]), []).append(r)
    right = 0
    for n, group in by_len.items():
        out = sampler([r["prompt"] for r in group], max_generation_steps=spec["max_new_tokens"],
                      max_prompt_length=n, eos_tokens=[spec["eos_id"]], temperature=0.0)  # fmt: skip
        for r, text in zip(group, out.text, strict=True):
            right += reward(spec["reward"], text, r["answer"]) >= 1.0
    return right / len(rows)


def main(argv: list[str]) -> None:
    spec = load_spec(argv[1])
    if "--step0" not in argv:
        raise SystemExit("tunix: only the step-0 check is implemented (GRPOLearner training is not)")
    import jax
    import transformers
    from tunix.generate import sampler as sampler_lib

    tok = transformers.AutoTokenizer.from_pretrained(spec["model_dir"], bos_token=None)
    heldout = read_jsonl(spec["heldout_jsonl"])
    for r in heldout[:50]:
        got = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        if got != r["prompt_ids"]:
            raise SystemExit(f"tokenizer mismatch on {r['prompt']!r}: {got} vs ours {r['prompt_ids']}")
    model, cfg, mesh = load_model(spec["model_dir"])
    longest = max(len(r["prompt_ids"]) for r in heldout)
    size = longest + spec["max_new_tokens"] + 8
    cache = sampler_lib.CacheConfig(cache_size=size, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                    head_dim=cfg.head_dim)  # fmt: skip
    clock = Clock()
    with jax.set_mesh(mesh):
        sampler = sampler_lib.Sampler(model, tok, cache)
        clock.evaluate(0, lambda: greedy_accuracy(sampler, heldout, spec))
    import importlib.metadata as md

    version = md.version("google-tunix")
    write_result(argv[2], "tunix", version, clock, PATCHES, versions={"jax": jax.__version__})


if __name__ == "__main__":
    main(sys.argv)
