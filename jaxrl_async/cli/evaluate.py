"""Held-out greedy accuracy of a run's checkpoints, on the held-out set its config defines.

  jaxrl-evaluate --config=configs/letter_range.py --checkpoint RUN [--steps 50,100]
      [--split train] [--by_length]

RUN: one of our runs (its workdir, its checkpoints/ directory or a step in it). `--config` is the run's
config with the run's overrides (the data seed and `eval_prompts` name the held-out prompts); the
prompts, their weights (letter_range's exact accuracy weighs each range by its probability), the greedy
eval engine's settings and the reward are the run's own. So a version's figure here is the one the run
logged for it when the run evaluated with its own eval engine (config.eval_weights="own"), and any
saved version can be scored again, with a larger held-out set (`--config.eval_prompts`) included. Prints
one line per version, `version V: held-out accuracy A (N prompts)`, and with --out writes them as JSON
({version: accuracy}).

--split=train scores the training split's problems the same way (distinct prompts, the same weights):
beside the held-out figure it shows how much of what a run learned carries over to problems it never
trained on (letter_range's training split holds 2,429 ranges: --config.eval_prompts=2429 scores all of
them). --by_length adds, per version, the accuracy in bands of the reference answer's length in
tokens, each band's share of the weight and its number of prompts (on a long-tailed task: where the
misses are); the JSON is then {version: {"accuracy": A, "by_length": {band: {...}}}}.

--expected_reward adds, per version, the held-out expected reward (runtime/expected_reward.py): the exact
probability that the run's sampler (its temperature and stop tokens) writes the reference answer,
weighted as the accuracy is, with its standard error over the prompts. It resolves differences that
greedy accuracy's 0/1 per prompt cannot; tasks with an exact-match reward only (arithmetic,
letter_range). The JSON then holds {"accuracy", "expected_reward", "expected_reward_stderr"} per version.
"""

from __future__ import annotations

import json

from absl import app, flags
from ml_collections import config_flags

from jaxrl_async.cli import run_command

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's config file.", lock_config=True)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A run's workdir, checkpoints/ or a step in it.")
_STEPS = flags.DEFINE_list("steps", None, "Versions to evaluate (default: the newest or the given step).")
_OUT = flags.DEFINE_string("out", "", "Also write the figures here as JSON.")
_SPLIT = flags.DEFINE_enum("split", "test", ["test", "train"], "Held-out prompts, or the training split's.")
_BY_LENGTH = flags.DEFINE_bool("by_length", False, "Also the accuracy per band of reference answer length.")
_EXPECTED = flags.DEFINE_bool("expected_reward", False, "Also the exact held-out expected reward (sampling).")
flags.mark_flags_as_required(["config", "checkpoint"])


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    from jaxrl_async.runtime.cluster import prepare_devices

    prepare_devices(_CONFIG.value)  # before JAX picks a backend
    import jax

    from jaxrl_async.data import held_out_prompts
    from jaxrl_async.rewards import RewardService
    from jaxrl_async.run_config import ConfigError, validate
    from jaxrl_async.runtime.build import build_tokenizer, sampler_config
    from jaxrl_async.runtime.checkpoint import find_checkpoints, load_policy
    from jaxrl_async.runtime.evaluation import (
        accuracy_by_length,
        eval_sampler_config,
        grade_greedy,
        weighted_accuracy,
    )
    from jaxrl_async.runtime.expected_reward import check_applicable, expected_reward
    from jaxrl_async.sampler import Engine
    from jaxrl_async.sharding import SAMPLER_RULES, make_mesh

    try:
        run = validate(_CONFIG.value, len(jax.devices()))
    except ConfigError as e:
        raise app.UsageError(f"invalid config: {e}") from None
    try:
        steps = [int(s) for s in _STEPS.value] if _STEPS.value else [None]
    except ValueError:
        raise app.UsageError(f"--steps: comma-separated integers, got {','.join(_STEPS.value)!r}") from None
    if find_checkpoints(_CHECKPOINT.value) is None:
        raise app.UsageError(f"--checkpoint {_CHECKPOINT.value}: not a run of ours (no model.json found)")
    tokenizer = build_tokenizer(run)
    sampling = sampler_config(run, tokenizer)
    if _EXPECTED.value:
        try:
            check_applicable(run.reward.reward, sampling.temperature, sampling.top_k, sampling.top_p)
        except ValueError as e:
            raise app.UsageError(f"--expected_reward: {e}") from None
    prompts = held_out_prompts(run.data, tokenizer, run.eval.prompts, _SPLIT.value)
    name = "held-out" if _SPLIT.value == "test" else "train-split"
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    rewards = RewardService(run.reward)
    results, engine = {}, None
    try:
        for step in steps:
            model_cfg, params, _, version = load_policy(_CHECKPOINT.value, mesh, SAMPLER_RULES, step)
            if engine is None:  # one engine (one compilation) for every version: they share the model
                cfg = eval_sampler_config(sampling, 1, run.eval.slots)
                engine = Engine(model_cfg.compute_copy(), None, mesh, cfg)
            graded = grade_greedy(engine, rewards, tokenizer, prompts, params, version)
            accuracy = weighted_accuracy(graded)
            print(f"version {version}: {name} accuracy {accuracy:.4f} ({len(prompts)} prompts)", flush=True)
            results[version] = accuracy
            if _BY_LENGTH.value or _EXPECTED.value:
                results[version] = {"accuracy": accuracy}
            if _EXPECTED.value:
                e = expected_reward(model_cfg.compute_copy(), params, prompts=prompts, tokenizer=tokenizer,
                                    stop_tokens=sampling.stop_tokens, max_new_tokens=sampling.max_new_tokens,
                                    temperature=sampling.temperature)
                print(f"version {version}: {name} expected reward {e.mean:.4f} +- {e.stderr:.4f} (standard "
                      f"error, {e.prompts} prompts)", flush=True)  # fmt: skip
                results[version].update(expected_reward=e.mean, expected_reward_stderr=e.stderr)
            if _BY_LENGTH.value:
                bands = accuracy_by_length(graded, tokenizer)
                results[version]["by_length"] = bands
                for band, b in bands.items():
                    print(f"  answer {band} tokens: accuracy {b['accuracy']:.3f} (weight {b['weight']:.3f}, "
                          f"{b['prompts']} prompts)", flush=True)  # fmt: skip
    finally:
        rewards.close()
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump({str(v): r for v, r in results.items()}, f, indent=1)


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":
    run()
