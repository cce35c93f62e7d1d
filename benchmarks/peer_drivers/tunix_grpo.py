"""Tunix's own GRPO loop (`GRPOLearner`, 0.1.7, its vanilla sampler) on the benchmark's spec.

  python tunix_grpo.py SPEC.json RESULT.json [--step0] [--as-shipped]

Runs in the Tunix venv that benchmarks/bench_peers.py builds. Settings from the spec: the warm start, the
prompts in our order (batches of prompts_per_step, no shuffle), the reward, samples per prompt, new
tokens, temperature, AdamW with our schedule (optax's warmup-cosine, as ours) after a global-norm clip,
the clip range (Tunix's GRPO clip is symmetric: epsilon = eps_low), no KL (beta 0), one update per batch,
token-level loss aggregation ("token-mean"). Held-out evaluations run between steps with a fresh vanilla
sampler on the actor's current weights, off the clock. --step0: only the step-0 evaluation.
--as-shipped: train without the stop-token patch below (what Tunix's loop does on its own).
What Tunix needs to match transformers' logits on our export, each listed in the result's "patches":
  - its Llama-3 attention calls `apply_rope` without the config's rope_theta (always its default 1e6):
    the driver wraps the module's `apply_rope` to pass the exported rope_theta (a patch of Tunix, in this
    process only);
  - its KV-cache update fails on jax's default explicit mesh axes: the mesh is built with AxisType.Auto;
  - its sampler prepends BOS when the tokenizer reports one: the tokenizer is loaded with bos_token=None
    (our prompts carry no BOS).
What its GRPO loop needs to learn a task whose answer ends where the model stops (letter_range):
  - its sampler cuts each completion before its first stop token, and the learner's completion mask is
    "not pad", so the stop token is never in the loss: no sample is rewarded for stopping where it did.
    The driver appends the stop token to every completion that ended on one (shorter than the new-token
    limit), as TRL and ours train it.
"""

from __future__ import annotations

import functools
import json
import os
import sys

# common.py lies beside this copy: a script's own directory is on its sys.path.
from common import Clock, load_spec, read_jsonl, reward, with_stop_token, write_result

PATCHES = [
    "llama3.model.apply_rope wrapped to use the exported rope_theta (Tunix always uses 1e6)",
    "mesh axes AxisType.Auto (the KV-cache update fails on explicit axes)",
    "tokenizer loaded with bos_token=None (the sampler prepends BOS when the tokenizer has one)",
]
STOP_PATCH = "the stop token appended to sampled completions that ended on it (Tunix cuts it: never trained)"


def train_the_stop_token(max_new: int, eos_id: int) -> None:
    """Wraps the vanilla rollout's generate (this process only): a completion shorter than the new-token
    limit ended on the stop token, which Tunix's sampler cut; it is put back, so the learner's "not pad"
    mask covers it and the stop decision gets its advantage like every other token."""
    import dataclasses

    import numpy as np
    from tunix.rl.rollout import vanilla_rollout

    generate = vanilla_rollout.VanillaRollout.generate

    def with_stop(self, prompts, rollout_config, **kwargs):
        out = generate(self, prompts, rollout_config, **kwargs)
        cut = out.tokens
        put_back = with_stop_token(cut, max_new, eos_id)
        tokens = [np.asarray(t, c.dtype) for t, c in zip(put_back, cut, strict=True)]
        return dataclasses.replace(out, tokens=tokens)

    vanilla_rollout.VanillaRollout.generate = with_stop


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
    """Held-out greedy exact match (weighted by each row's "weight"), prompts grouped by length (no
    padding)."""
    by_len: dict[int, list[dict]] = {}
    for r in rows:
        by_len.setdefault(len(r["prompt_ids"]), []).append(r)
    right = 0.0
    for n, group in by_len.items():
        out = sampler([r["prompt"] for r in group], max_generation_steps=spec["max_new_tokens"],
                      max_prompt_length=n, eos_tokens=[spec["eos_id"]], temperature=0.0)  # fmt: skip
        for r, text in zip(group, out.text, strict=True):
            right += r["weight"] * (reward(spec["reward"], text, r["answer"]) >= 1.0)
    return right / sum(r["weight"] for r in rows)


def main(argv: list[str]) -> None:
    spec = load_spec(argv[1])
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
    if spec["eps_high"] != spec["eps_low"]:
        print(f"note: Tunix's GRPO clip is symmetric; epsilon = eps_low = {spec['eps_low']}", flush=True)
    longest = max(len(r["prompt_ids"]) for r in heldout)
    size = longest + spec["max_new_tokens"] + 8
    cache = sampler_lib.CacheConfig(cache_size=size, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                    head_dim=cfg.head_dim)  # fmt: skip
    clock = Clock()
    evaluate = lambda m: greedy_accuracy(sampler_lib.Sampler(m, tok, cache), heldout, spec)  # noqa: E731
    with jax.set_mesh(mesh):
        clock.evaluate(0, lambda: evaluate(model))
        if "--step0" not in argv:
            if "--as-shipped" not in argv:
                train_the_stop_token(spec["max_new_tokens"], spec["eos_id"])
            train(spec, model, tok, mesh, clock, evaluate)
    import importlib.metadata as md

    version = md.version("google-tunix")
    patches = PATCHES + ([STOP_PATCH] if "--step0" not in argv and "--as-shipped" not in argv else [])
    write_result(argv[2], "tunix", version, clock, patches, versions={"jax": jax.__version__})


def train(spec: dict, model, tok, mesh, clock: Clock, evaluate) -> None:
    """GRPOLearner.train over our batches; the data iterator evaluates before handing out batch k when k
    is an evaluation step (the learner asks for batch k after step k's weights are synced)."""
    import numpy as np
    import optax
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    steps, size, every = spec["steps"], spec["prompts_per_step"], spec["eval_every"]
    train_rows = read_jsonl(spec["train_jsonl"])
    longest = max(len(r["prompt_ids"]) for r in train_rows[: steps * size])
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if spec["warmup_steps"] else spec["lr"], peak_value=spec["lr"],
        warmup_steps=spec["warmup_steps"], decay_steps=spec["schedule_steps"],
        end_value=spec["lr"] * spec["end_lr_ratio"],
    )  # fmt: skip
    tx = optax.adamw(schedule, b1=spec["b1"], b2=spec["b2"], eps=spec["adam_eps"],
                     weight_decay=spec["weight_decay"])  # fmt: skip
    if spec["clip_norm"]:
        tx = optax.chain(optax.clip_by_global_norm(spec["clip_norm"]), tx)
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=spec["max_new_tokens"], max_prompt_length=longest,
        kv_cache_size=longest + spec["max_new_tokens"] + 8, temperature=spec["temperature"], top_p=1.0,
        top_k=None, eos_tokens=[spec["eos_id"]],
    )  # fmt: skip
    roles = rl_cluster_lib.Role
    cluster = rl_cluster_lib.RLCluster(
        actor=model, reference=None, tokenizer=tok,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
            rollout_engine="vanilla", offload_to_cpu=False, rollout_config=rollout,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=tx, eval_every_n_steps=10**9, max_steps=steps, pbar_description=None,
            ),
        ),
    )  # fmt: skip
    algo = grpo_learner.GRPOConfig(num_generations=spec["samples_per_prompt"], num_iterations=1, beta=0.0,
                                   epsilon=spec["eps_low"], loss_agg_mode="token-mean")  # fmt: skip
    max_new = spec["max_new_tokens"]

    def reward_fn(prompts, completions, answer, **_):
        for p, c in zip(prompts, completions, strict=True):
            n = min(len(tok(c, add_special_tokens=False)["input_ids"]) + 1, max_new)  # + eos unless cut
            clock.trained_tokens += len(tok(p, add_special_tokens=False)["input_ids"]) + n
        return [reward(spec["reward"], c, a) for c, a in zip(completions, answer, strict=True)]

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=[reward_fn])

    def batches():
        for k in range(steps):
            if k and k % every == 0:
                clock.evaluate(k, lambda: evaluate(cluster.actor_trainer.model))
            rows = train_rows[k * size : (k + 1) * size]
            # numpy arrays, as Tunix's data path merges and repeats them (lists come out nested)
            yield {key: np.asarray([r[field] for r in rows]) for key, field in (("prompts", "prompt"),
                                                                                ("answer", "answer"))}

    clock.restart()
    learner.train(batches())
    clock.evaluate(steps, lambda: evaluate(cluster.actor_trainer.model))

if __name__ == "__main__":
    main(sys.argv)
