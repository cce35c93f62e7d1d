"""A learnable task with a real long tail: letter ranges ("range d-k:" -> "defghijk"), tiny_arith's setup.

Why this task: asynchronous RL gains wall time when some completions are much longer than the others
(a synchronous step waits for its longest sequence while the rest of the batch is done). 2-digit
addition has answers of 2-4 tokens, so the demo cannot show it; benchmarks/configs/bench_async.py draws
lengths from a sampler, so it shows throughput, not learning. Here the tail comes from the problems: a
range's span,
the answer's length, is exp(u^1.5 ln 53) letters for u uniform, so short ranges are common and long ones
rare but present. The reference completions (stop token included) have median 4 and p99 50 tokens
(tests/test_letter_range.py checks p99/median >= 4), and the policy's own keep that tail: p99/median
7.3-8.7 in six 100-step runs (docs/history/benchmarks.md). Every answer letter follows from the one before
and the stop from the prompt's last letter, so a tiny character model learns the task from a short supervised
warm start; RL then raised held-out accuracy from 0.30 to 0.39-0.50 in 100 steps (3 seeds, sync and
async). Its misses are on short ranges (it runs past the stop, often the wrong way;
`jaxrl-evaluate --by_length`). The verifier (rewards "letter_range") rebuilds the answer from the
prompt's metadata: 1.0 for the exact answer, else 0.

Two settings make the policy's own tail and the held-out figure trustworthy (docs/history/benchmarks.md,
"Time to accuracy on a long-tailed task"):
- span power 1.5, not the log-uniform 1: at 1 a policy that still overshoots the stop writes completions
  with median 16-21 tokens, p99/median 2.7-3.0, under the tail the task is for;
- one-letter ranges are never held out: the tiny model memorizes the trained ones (0.83 right) and does
  not infer the unseen ones (0-0.17). There are only 52 of them, so the 6 in the held-out split carried
  19-33% of the held-out weight and each one moved the exact accuracy by 3-5.5 points; without them the
  heaviest held-out prompt moves it by 1.5.
"""

from jaxrl_async.cli.config_file import sibling

tiny_arith = sibling(__file__, "tiny_arith")

PROMPT_LEN = 10  # "range d-k:"
LONGEST = 52  # letters in the longest answer (the whole alphabet, a..z then A..Z)


def get_config():
    c = tiny_arith.get_config()
    c.workdir = "runs/letter_range"  # TensorBoard events, checkpoints, summary.json
    c.mode = "async"  # sampling and training overlap (benchmarks/bench_learning.py also runs "sync")
    # η: tiny_arith's. At the learning rate below async ends level with sync at 2 (+1.0 points, six
    # seeds) and at 5 (-0.9), and 5 ends 1.9 points under 2 (docs/history/benchmarks.md, runs X to Z2).
    c.max_staleness = 2
    # Half tiny_arith's 3e-4: in 100 steps sync learned as much (+0.6 points, six seeds) and async more
    # (+2.3 at η = 2; at η = 5 3e-4 left it 3.6 points under sync). Runs before Z ran at 3e-4.
    c.trainer.lr = 1.5e-4
    c.total_steps = 200  # RL steps; the warm start comes before and is cached
    # Groups per train step: at span power 1, held-out accuracy 0.315 -> 0.45 in 100 RL steps with 64,
    # 0.315 -> 0.345 with 32 (one run each, exact reward).
    c.prompts_per_step = 64
    c.samples_per_prompt = 8  # completions per prompt (GRPO group size)
    # Naive PPO: the ratio to the behaviour policy, clipped. With one update a step, decoupled PPO's clip is
    # around pi_theta itself and never binds; at η = 2 it ended 7 points below sync, naive PPO level with
    # it (3 seeds each, exact held-out accuracy at step 100; docs/history/benchmarks.md). In sync mode the two
    # losses are the same (pi_behav = pi_theta).
    c.trainer.loss = "ppo"
    c.eval_every = 10  # train steps between held-out evaluations (time to accuracy is read from them)
    # Every held-out range once (the split holds 269), weighted by its probability: the exact held-out
    # accuracy, with no sampling noise (jaxrl_async.data.letter_range; 200 draws had a standard error ~0.03).
    c.eval_prompts = 269
    c.text_samples = 2  # completions written to TensorBoard as text per step

    c.data.task = "letter_range"  # jaxrl_async.data.letter_range; its reward is "letter_range"
    c.data.letter_span_power = 1.5  # spans exp(u^1.5 ln 53): short ranges common, long ones rare (above)
    c.data.letter_heldout_min_span = 2  # one-letter ranges all train; the held-out split is the rest's
    c.sampler.max_prompt_len = 12  # the prompt is PROMPT_LEN characters; one bucket covers every prompt
    c.sampler.prompt_buckets = (12,)
    c.sampler.max_new_tokens = LONGEST + 2  # the longest answer, its stop token and one spare
    # A packed row holds the longest sequence the sampler can make: max_prompt_len + max_new_tokens = 66.
    c.trainer.token_budget = 72
    c.trainer.rows_per_micro = 64  # rows per micro-batch: the sequences of a batch pack into a few rows

    c.warm_start.seq_len = 64  # prompt + longest answer + stop = 63 tokens
    # Stops at the first check at or above this, so RL starts from about a third right (most misses on
    # the short ranges).
    c.warm_start.target_accuracy = 0.3
    c.warm_start.max_steps = 400  # upper bound on supervised steps (batch 128, checked every 5)
    return c
