"""Long answers: the shift task (24 digits in, each plus one mod 10 out) in tiny_arith's setting.

Each answer is 24 tokens plus the stop token, so at 4 decode steps per sampler call a weight update that
arrives while a sequence is being generated lands in its middle (the sampler's in-flight updates, which
2-digit addition, with answers of at most 3 digits, almost never sees). Reward: the share of answer
positions right (rewards.synthetic.shift_reward); held-out accuracy counts exact answers.
"""

from jaxrl_async.cli.config_file import sibling

tiny_arith = sibling(__file__, "tiny_arith")

DIGITS = 24


def get_config():
    c = tiny_arith.get_config()
    c.workdir = "runs/long_answer"
    c.data.task = "shift"
    c.data.digits = DIGITS
    c.sampler.max_prompt_len = 32  # "shift " + 24 digits + ":" = 31 characters
    c.sampler.prompt_buckets = (32,)
    c.sampler.max_new_tokens = DIGITS + 2  # the answer, its stop token and one spare
    c.trainer.token_budget = 64  # one sequence: 31 + 26 - 1 = 56 positions
    c.trainer.rows_per_micro = 64
    c.warm_start.seq_len = 64
    return c
