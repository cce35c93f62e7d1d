"""The CPU default: a tiny model learns 2-digit addition with asynchronous RL on two fake CPU devices.

A cached supervised warm start brings held-out accuracy to 33-40% so RL has signal; RL (decoupled PPO,
GRPO advantages, max_staleness = 2) takes it the rest of the way.

Each role gets one fake CPU device: on a 2-core machine, splitting a sub-million-parameter model over
fake devices only adds collectives (40 steps: 4,514 vs 7,539 trained tokens/s for (2,1)+(2,1) vs
(1,1)+(1,1)), and every fake device beyond the used ones slows XLA:CPU (steady trained tokens/s: 10,915
with 2 devices vs 8,929 with 8, one run each of this config on the idle machine). The sharded paths
are the same code; `--config.mesh.sampler=(2,1) --config.mesh.trainer=(2,1)
--config.mesh.fake_cpu_devices=4` runs them.
"""

from jaxrl_async.cli.config_file import sibling

base = sibling(__file__, "base")


def get_config():
    c = base.get_config()
    c.workdir = "runs/tiny_arith"
    c.mode = "async"
    c.max_staleness = 2
    c.total_steps = 1000
    c.prompts_per_step = 64
    c.samples_per_prompt = 8
    c.tokenizer = "char"
    c.eval_every = 20
    c.eval_prompts = 400  # standard error ~0.015 near 90%
    c.text_samples = 4

    c.model.preset = "tiny"
    # A third layer learns addition much faster per RL step than the preset's two (held-out accuracy
    # after 200 steps on a GPU sweep: 0.78 vs 0.545), for ~1.3x the step cost.
    c.model.n_layers = 3
    c.mesh.sampler = (1, 1)
    c.mesh.trainer = (1, 1)
    c.mesh.fake_cpu_devices = 2  # the two the roles use

    c.data.task = "arithmetic"
    c.data.digits = 2
    c.data.operators = "+"
    c.data.num_epochs = None
    c.reward.num_workers = 1
    c.reward.timeout_s = 5.0

    c.sampler.num_slots = 128
    c.sampler.max_prompt_len = 8
    c.sampler.max_new_tokens = 6
    c.sampler.prompt_buckets = (8,)
    c.sampler.steps_per_call = 4
    c.sampler.temperature = 1.0
    c.sampler.update_mode = "keep_kv"

    c.trainer.loss = "decoupled_ppo"
    c.trainer.advantage = "grpo"
    c.trainer.lr = 3e-4  # 1e-3 collapsed the policy here (accuracy 0.33 -> 0.17 in 40 steps)
    c.trainer.warmup_steps = 5
    # The demo's schedule, whatever --config.total_steps says: a shorter run is its first steps.
    c.trainer.total_steps = 1000
    # Groups whose 8 rewards are all equal carry no policy gradient; leaving them out makes late steps
    # (most groups solved) much cheaper.
    c.trainer.skip_zero_advantage = True
    # Cosine decay to 0.1x: at a constant rate accuracy stalled near 0.85 with +-0.05 swings.
    c.trainer.end_lr_ratio = 0.1
    c.trainer.clip_norm = 1.0
    # One optimizer update per batch (pi_prox = pi_theta, so the clip never binds; the default is 4):
    # the curve in docs/history/benchmarks.md was measured so, and 4 adds a pi_prox forward and 3 updates a
    # step.
    c.trainer.minibatches = 1
    c.trainer.token_budget = 32  # short rows: attention cost grows with the row length squared
    c.trainer.rows_per_micro = 128
    # Three layers: unrolled, XLA:CPU skips the layer scan's stacked residuals (the train micro-batch
    # 0.29 -> 0.235 s on letter_range's shape; docs/history/benchmarks.md).
    c.trainer.unroll_layers = True

    c.warm_start.enabled = True
    c.warm_start.max_steps = 400
    c.warm_start.batch = 128
    c.warm_start.seq_len = 12
    c.warm_start.lr = 1e-3
    c.warm_start.target_accuracy = 0.33  # RL starts at or a little above this (checked every 5 steps)
    c.warm_start.eval_every = 5
    return c
