"""The calculator task's warm start, measured with the tool and without it (issue 55's learning task).

  JAX_PLATFORMS=cpu python -m benchmarks.bench_calc_tool [--steps 300] [--eval_every 50] [--prompts 200]
  JAX_PLATFORMS=cpu python -m benchmarks.bench_calc_tool --score DIR[,DIR...]

Trains the supervised warm start of configs/calc_tool.py (reference episodes, the calculator's results
masked out of the loss: `trainer.warmstart`) from a random init, and at every check runs the held-out
prompts as greedy multi-turn episodes on a sampler (`envs.driver.EpisodeDriver`: parked slots, tool
results appended to the slot's cache) three ways:
  - tool: the calculator is available (config.env of configs/calc_tool.py);
  - no_tool: it is not (`EnvConfig.tools = ()`): a call is answered with the "unknown tool" error
    observation and the model's next turn is graded;
  - withheld: a call is answered with an empty result (`<result></result>`): what the model answers
    when it asked and got nothing, i.e. what it knows of the product without the tool.
With --score nothing trains: each DIR (a Hugging Face directory: a run's cached warm start, or a
checkpoint written by `jaxrl-export-hf`) is scored the same three ways, once.
The issue's goal for the warm-started model: at most 20% held-out without the tool. Also reported: the
share of episodes that called twice, how episodes ended, the CPU model and the load average (a loaded
machine makes the seconds slower, not the accuracies different).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import tempfile
import time

import jax
from absl import app, flags

from benchmarks.machine import cpu_model
from jaxrl_async.data import DataConfig, held_out_prompts, make_prompt_iterator
from jaxrl_async.data.calc_tool import reference_segments
from jaxrl_async.envs import EnvConfig, StepResult, get_format, tool_env_factory
from jaxrl_async.envs.driver import EpisodeDriver
from jaxrl_async.model import init_params, load_hf, presets
from jaxrl_async.rewards.registry import get_reward
from jaxrl_async.runtime.weight_sync import WeightSync
from jaxrl_async.sampler import Engine, SamplerConfig, SamplerLoop
from jaxrl_async.sharding import TRAINER_RULES, make_mesh
from jaxrl_async.tokenizer import CharTokenizer
from jaxrl_async.trainer.warmstart import WarmStartConfig, episode_example, warm_start

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 300, "warm-start steps")
flags.DEFINE_integer("eval_every", 50, "warm-start steps between held-out checks")
flags.DEFINE_integer("batch", 64, "warm-start sequences per step")
flags.DEFINE_float("lr", 1e-3, "warm-start learning rate")
flags.DEFINE_integer("prompts", 200, "held-out prompts per check")
flags.DEFINE_integer("seed", 0, "parameter init seed")
flags.DEFINE_integer("data_seed", 0, "data seed (rows and held-out split)")
flags.DEFINE_integer("slots", 64, "sampler slots of the greedy engine")
flags.DEFINE_string("json_out", None, "write the results here as JSON")
flags.DEFINE_list("score", [], "Hugging Face directories to score (tool, no tool, withheld); nothing trains")

DIGITS = 3  # configs/calc_tool.py's data.digits
N_LAYERS = 3  # configs/calc_tool.py's model.n_layers
SEQ_LEN = 144  # the longest reference episode: prompt 19 + turns and observations 125 tokens
MAX_PROMPT_LEN = 24
EPISODE_TOKENS = 136  # tokens after the prompt: the longest reference episode's 125 and some room
TURN_TOKENS = 40  # the longest call turn is 38 characters and its stop token


class Withheld:
    """The calculator asked and answering nothing: a call turn gets `<result></result>`, any other turn
    is the answer (graded like ToolEnv's)."""

    def __init__(self, row, reward_fn, max_turns: int):
        self.row, self.reward_fn, self.max_turns, self.turns = row, reward_fn, max_turns, 0
        self.format = get_format("tags")

    def step(self, turn: str) -> StepResult:
        self.turns += 1
        if self.format.parse(turn) is None:
            return StepResult(None, float(self.reward_fn(self.row, turn)), True, {"reason": "answer"})
        if self.turns >= self.max_turns:
            return StepResult(None, 0.0, True, {"reason": "max_turns"})
        return StepResult("<result></result>", 0.0, False, {"reason": "tool"})


def env_config(tools: tuple[str, ...]) -> EnvConfig:
    return EnvConfig(tools=tools, max_turns=4, max_tool_calls=3, max_observation_tokens=48,
                     max_episode_tokens=EPISODE_TOKENS)  # fmt: skip


def run_episodes(engine: Engine, tok, prompts, mode: str) -> dict:
    """Greedy episodes of every prompt under `mode` (tool, no_tool, withheld): accuracy and how they went."""
    reward = get_reward("calc_tool")
    reward_fn = lambda row, text: reward(row.text, text, row.metadata)
    cfg = env_config(("calculator",) if mode == "tool" else ())
    if mode == "withheld":
        make_env, executor = (lambda row: Withheld(row, reward_fn, cfg.max_turns)), None
    else:
        make_env, executor = tool_env_factory(cfg, tok, reward_fn)
    driver = EpisodeDriver(SamplerLoop(engine), cfg, tok, make_env, workers=4, max_turn_tokens=TURN_TOKENS)
    for i, p in enumerate(prompts):
        driver.add(p.uid, p, p.tokens, seed=i)
    episodes = driver.run()
    driver.close()
    if executor is not None:
        executor.close()
    two_call = {p.uid for p in prompts if "+" in p.metadata["expression"]}
    right = [e.reward >= 1.0 for e in episodes]
    right_two = [e.reward >= 1.0 for e in episodes if e.uid in two_call]
    return {
        "accuracy": sum(right) / len(episodes),
        "accuracy_two_call_rows": sum(right_two) / max(len(right_two), 1),
        "turns_mean": sum(e.turns for e in episodes) / len(episodes),
        "called_twice": sum(e.turns >= 3 for e in episodes) / len(episodes),
        "finish": dict(collections.Counter(e.finish_reason for e in episodes)),
    }


def _engine(model, device) -> Engine:
    """The greedy episode engine the checks run on."""
    scfg = SamplerConfig(num_slots=FLAGS.slots, max_prompt_len=MAX_PROMPT_LEN, max_new_tokens=EPISODE_TOKENS,
                         prompt_buckets=(MAX_PROMPT_LEN,), steps_per_call=4, temperature=0.0,
                         stop_tokens=(CharTokenizer().eos_id,), attention="xla", linear="xla")  # fmt: skip
    return Engine(model.compute_copy(), None, make_mesh((1, 1), ("data", "tensor"), [device]), scfg)


def score(paths: list[str]) -> None:
    """--score: each directory's held-out accuracy with the tool, without it and with results withheld."""
    tok, device = CharTokenizer(), jax.devices()[0]
    prompts = held_out_prompts(DataConfig(task="calc_tool", digits=DIGITS, seed=FLAGS.data_seed), tok,
                               FLAGS.prompts)  # fmt: skip
    rows = []
    for path in paths:
        model, params = load_hf(path)
        engine = _engine(model, device)
        engine.update_params(WeightSync(model, engine.mesh)(params), 0)
        row = {"path": path}
        row.update({m: run_episodes(engine, tok, prompts, m) for m in ("tool", "no_tool", "withheld")})
        rows.append(row)
        print(f"{path}: with tool {row['tool']['accuracy']:.3f}, no tool {row['no_tool']['accuracy']:.3f}, "
              f"withheld {row['withheld']['accuracy']:.3f} ({len(prompts)} held-out prompts)", flush=True)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"cpu": cpu_model(), "rows": rows}, f, indent=1)


def main(_):
    if FLAGS.score:
        return score(FLAGS.score)
    tok = CharTokenizer()
    data = DataConfig(task="calc_tool", digits=DIGITS, seed=FLAGS.data_seed, num_epochs=None)
    vocab = -(-tok.vocab_size // 8) * 8  # as the run pads it (runtime/build.py: model_config)
    model = presets.tiny(vocab_size=vocab, n_layers=N_LAYERS, eos_token_id=tok.eos_id)
    device = jax.devices()[0]
    params = init_params(model, jax.random.key(FLAGS.seed), make_mesh((1, 1), ("fsdp", "tensor"), [device]),
                         TRAINER_RULES)  # fmt: skip
    engine = _engine(model, device)
    sync = WeightSync(model, engine.mesh)
    prompts = held_out_prompts(data, tok, FLAGS.prompts)
    # The run's warm start draws its rows with this seed offset (runtime/build.py: warm_started_params).
    it = make_prompt_iterator(dataclasses.replace(data, seed=data.seed + 7919), tok)
    examples = (episode_example(tok.encode, tok.eos_id, p.tokens, reference_segments(p.text)) for p in it)

    checks = []

    def evaluate(p) -> float:
        """Every check: the three modes; the warm start stops on the with-tool accuracy."""
        t0 = time.perf_counter()
        engine.update_params(sync(p), len(checks))
        row = {"step": len(checks) * FLAGS.eval_every}
        for mode in ("tool", "no_tool", "withheld"):
            row[mode] = run_episodes(engine, tok, prompts, mode)
        row["eval_s"] = time.perf_counter() - t0
        checks.append(row)
        print(f"step {row['step']:>4}: with tool {row['tool']['accuracy']:.3f} "
              f"(two-call rows {row['tool']['accuracy_two_call_rows']:.3f}), "
              f"no tool {row['no_tool']['accuracy']:.3f}, withheld {row['withheld']['accuracy']:.3f}, "
              f"eval {row['eval_s']:.1f} s, load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        return row["tool"]["accuracy"]

    ws = WarmStartConfig(max_steps=FLAGS.steps, batch=FLAGS.batch, seq_len=SEQ_LEN, lr=FLAGS.lr,
                         target_accuracy=1.0, eval_every=FLAGS.eval_every,
                         cache_dir=tempfile.mkdtemp(prefix="calc_ws_"))  # fmt: skip
    t0 = time.perf_counter()

    def progress(step: int, total: int) -> None:
        if step % 10 == 0:
            print(f"  warm-start step {step}/{total}: {time.perf_counter() - t0:.0f} s", flush=True)

    _, info = warm_start(model, params, examples, evaluate, ws, key="bench", progress=progress)
    wall = time.perf_counter() - t0
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "flags": {k: FLAGS[k].value for k in ("steps", "eval_every", "batch", "lr", "prompts", "seed",
                                               "data_seed", "slots")},  # fmt: skip
        "warm_start_steps": info["steps"],
        "wall_s": wall,
        "eval_s": sum(c["eval_s"] for c in checks),
        "checks": checks,
    }
    print(json.dumps(result, indent=1))
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
