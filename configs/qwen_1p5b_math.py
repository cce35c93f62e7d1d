"""Qwen2.5-1.5B (or any ~1.5B HF checkpoint) on a math JSONL: one 8-accelerator host (checked for 8 x H100).

  python launch/run.py --config=configs/qwen_1p5b_math.py \
      --config.model.checkpoint=/ckpt/Qwen2.5-1.5B-Instruct \
      --config.data.path=/data/gsm8k_train.jsonl --config.data.task=gsm8k --config.workdir=/runs/qwen1p5b
"""

from jaxrl_async.cli.config_file import sibling

base = sibling(__file__, "base")


def get_config():
    c = base.get_config()
    c.workdir = ""
    # Compiled programs kept between runs: a restart or resume loads them instead of compiling for minutes.
    # A local directory: each sampler host keeps its own programs; a bucket ("gs://...") instead gives every
    # trainer host process 0's entries (JAX writes from process 0 only), and sampler hosts then compile.
    c.compile_cache_dir = "~/.cache/jaxrl_async/xla"
    c.mode = "async"
    c.max_staleness = 4
    c.total_steps = 300
    c.prompts_per_step = 32
    c.samples_per_prompt = 8
    c.tokenizer = ""
    c.eval_every = 20
    c.eval_prompts = 300
    c.checkpoint_every = 20

    c.model.preset = ""
    c.model.checkpoint = ""  # REQUIRED: local HF directory
    c.model.dtype = "bfloat16"  # compute and the sampler's weights
    c.model.param_dtype = "float32"  # the trainer's master weights and AdamW state

    c.mesh.sampler = (6, 1)
    c.mesh.trainer = (2, 1)
    c.mesh.fake_cpu_devices = 8

    c.data.task = "jsonl"
    c.data.path = ""  # REQUIRED: JSONL of math problems
    c.data.template = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
    c.data.num_epochs = None
    c.data.max_prompt_tokens = 512
    c.reward.num_workers = 4

    # Long context: completions of up to 27,648 tokens (AReaL's boba math setting); 32 slots per sampler
    # GPU hold 25 GiB of bf16 KV (0.77 GiB per 28k-position slot). Checked with jaxrl-plan-check.
    c.sampler.num_slots = 192
    c.sampler.max_prompt_len = 512
    c.sampler.max_new_tokens = 27648
    c.sampler.prompt_buckets = (128, 256, 512)
    c.sampler.steps_per_call = 16
    c.sampler.temperature = 1.0

    c.trainer.lr = 1e-6
    c.trainer.warmup_steps = 5
    c.trainer.token_budget = 32768  # one row holds the longest prompt + completion (28,160 tokens)
    c.trainer.rows_per_micro = 2
    # Several optimizer updates per batch (AReaL's ppo_n_minibatches=4): with one, pi_prox equals
    # pi_theta and decoupled PPO's clip never binds.
    c.trainer.minibatches = 4
    c.trainer.compute_dtype = "bfloat16"
    c.trainer.remat = True
    return c
