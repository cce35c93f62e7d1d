"""The throughput workload of benchmarks/bench_async.py: a long-tailed completion-length mix on a tiny model.

`configs/tiny_arith.py` with a random 2-layer model (no warm start) and the reward "the completion contains
a digit", so every group carries a gradient. Each prompt's generation cap is drawn from a lognormal
(median 24, p99 96, cap 128 tokens) and the stop token is disabled, so completion lengths follow exactly
that distribution, in every mode alike. Throughput is what this config measures, not learning.
"""

from jaxrl_async.cli.config_file import sibling

tiny_arith = sibling(__file__, "../../configs/tiny_arith")


def get_config():
    c = tiny_arith.get_config()
    c.workdir = "runs/bench_async"
    c.max_staleness = 4
    c.total_steps = 30
    c.prompts_per_step = 16
    c.samples_per_prompt = 4
    c.eval_every = 0  # only the first and the last version are evaluated
    c.eval_prompts = 8
    c.text_samples = 0
    c.length_caps = "lognormal:median=24,p99=96,max=128,seed=1"

    c.model.n_layers = 2
    c.reward.reward = "format"
    c.reward.defaults = {"format_regex": "[0-9]"}

    # Exactly the devices the one-process runs use (sampler 1 + trainer 1): every further fake CPU device
    # slowed the train step (one core: 0.30 s per step with 8 devices, 0.22 s with 2).
    c.mesh.fake_cpu_devices = 2

    c.sampler.num_slots = 256
    c.sampler.max_new_tokens = 128
    c.sampler.stop_tokens = (-1,)  # never sampled: lengths are exactly the drawn caps

    c.trainer.lr = 1e-5
    c.trainer.token_budget = 256
    # One row per micro-batch: a step pays whole micro-batches, and with ~9 rows of data per batch 8-row
    # micro-batches padded it to 16 rows (benchmarks/bench_roles.py, one core: 0.27 s per step with 1 row,
    # 0.32 s with 2, 0.38 s with 4, 0.44 s with 8).
    c.trainer.rows_per_micro = 1
    c.trainer.skip_zero_advantage = False  # every sample is trained, whatever the rewards

    c.warm_start.enabled = False
    return c
