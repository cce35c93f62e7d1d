"""Tool latency with and without the episode driver's thread pool (issue 55: multi-turn episodes).

  JAX_PLATFORMS=cpu python -m benchmarks.bench_tool_latency [--latencies-ms 0,50,500] [--episodes 16]

Every episode has three model turns and two tool calls, each call taking the injected latency (a sleep,
as a remote tool would). Two ways to run the same episodes on the same engine, side by side in one run:
  - inline: after each decode call the finished turns' tools run one after another on the loop's thread,
    and decoding waits for them (a sampler whose tool calls block it);
  - driver: `envs.driver.EpisodeDriver`: tools run in a thread pool while the other slots decode, the
    parked slots waiting for their answers.
Reported: wall seconds, model tokens/s, and the parked-slot fraction, with the CPU model and load average.
Sampler-level figures: the run's trained tokens/s with injected tool latency, sync against async (issue
55's goal), is benchmarks/bench_tool_runs.py.
"""

from __future__ import annotations

import json
import os
import time

import jax
from absl import app, flags

from benchmarks.machine import cpu_model
from jaxrl_async.envs import EnvConfig, StepResult
from jaxrl_async.envs.driver import EpisodeDriver
from jaxrl_async.model import init_params, presets
from jaxrl_async.sampler import Engine, Request, SamplerConfig, SamplerLoop
from jaxrl_async.sharding import SAMPLER_RULES, make_mesh

FLAGS = flags.FLAGS
flags.DEFINE_list("latencies_ms", ["0", "50", "500"], "injected latency of one tool call")
flags.DEFINE_integer("episodes", 16, "episodes per cell")
flags.DEFINE_integer("slots", 8, "sampler slots (and the driver's threads)")
flags.DEFINE_string("json_out", None, "write the results here as JSON")

TURN_TOKENS = 16
OBSERVATION = [5, 6, 7, 8, 9, 10, 11, 12]


class SlowTool:
    """Answers two turns with an observation after `latency_s`, ends the episode at the third."""

    def __init__(self, latency_s: float):
        self.latency_s, self.turns = latency_s, 0

    def step(self, turn) -> StepResult:
        self.turns += 1
        if self.turns == 3:
            return StepResult(None, 1.0, True, {"reason": "answer"})
        time.sleep(self.latency_s)
        return StepResult(OBSERVATION, 0.0, False)


class Ids:
    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(str(int(i)) for i in ids)


def inline(engine: Engine, prompts, latency_s: float) -> tuple[int, SamplerLoop]:
    """The baseline: tools run on the loop's thread; returns (model tokens, loop)."""
    loop = SamplerLoop(engine)
    envs, tokens = {}, 0
    for i, p in enumerate(prompts):
        loop.add_request(Request(i, p, seed=i, max_new_tokens=TURN_TOKENS, park=True))
        envs[i] = SlowTool(latency_s)
    live = len(prompts)
    while live:
        for c in loop.step():
            tokens += len(c.tokens)
            result = envs[c.uid].step(None)
            if result.done:
                loop.finish(c.uid, c.sample_index)
                live -= 1
            else:
                loop.resume(c.uid, c.sample_index, result.observation, TURN_TOKENS)
    return tokens, loop


def pooled(engine: Engine, prompts, latency_s: float) -> tuple[int, SamplerLoop]:
    loop = SamplerLoop(engine)
    cfg = EnvConfig(max_turns=3, max_observation_tokens=len(OBSERVATION), max_episode_tokens=128)
    driver = EpisodeDriver(loop, cfg, Ids(), lambda row: SlowTool(latency_s), workers=engine.cfg.num_slots,
                           max_turn_tokens=TURN_TOKENS)  # fmt: skip
    for i, p in enumerate(prompts):
        driver.add(i, None, p, seed=i)
    episodes = driver.run()
    driver.close()
    return sum(e.length - e.observation_tokens for e in episodes), loop


def main(_):
    model = presets.tiny(vocab_size=128)
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    params = init_params(model, jax.random.key(0), mesh, SAMPLER_RULES)
    cfg = SamplerConfig(num_slots=FLAGS.slots, max_prompt_len=64, max_new_tokens=TURN_TOKENS,
                        steps_per_call=4, temperature=1.0, attention="xla", linear="xla")  # fmt: skip
    engine = Engine(model, params, mesh, cfg)
    prompts = [[3 + (i % 50), 4, 5, 6] for i in range(FLAGS.episodes)]
    inline(engine, prompts[:2], 0.0), pooled(engine, prompts[:2], 0.0)  # compile every shape
    rows = []
    for latency_ms in map(int, FLAGS.latencies_ms):
        for name, fn in (("inline", inline), ("driver", pooled)):
            t0 = time.perf_counter()
            tokens, loop = fn(engine, prompts, latency_ms / 1e3)
            wall = time.perf_counter() - t0
            rows.append({"latency_ms": latency_ms, "mode": name, "wall_s": wall, "model_tokens": tokens,
                         "tokens_per_s": tokens / wall,
                         "parked_fraction": loop.stats.parked_fraction})  # fmt: skip
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
              "load_average": os.getloadavg(), "episodes": FLAGS.episodes, "slots": FLAGS.slots,
              "rows": rows}  # fmt: skip
    print(json.dumps(result, indent=1))
    print(f"\n{'latency ms':>10} {'mode':>7} {'wall s':>7} {'tokens/s':>9} {'parked':>7}")
    for r in rows:
        print(f"{r['latency_ms']:>10} {r['mode']:>7} {r['wall_s']:>7.2f} {r['tokens_per_s']:>9.0f} "
              f"{r['parked_fraction']:>7.2f}")  # fmt: skip
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
