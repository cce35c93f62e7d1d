"""An 8B model (Qwen3-8B or Llama-3.1-8B from a local HF checkpoint) on a math JSONL with math-verify.

Layouts:
  default      TPU v5p-128 (64 chips, 16 hosts of 4): 12 sampler replicas of one host each (data 1 x
               tensor 4), trainer 16 chips on 4 hosts (fsdp 8 x tensor 2); launch/tpu_pod.sh's default.
  ":h100"      one 8 x H100 node: sampler 4 GPUs (data 4), trainer 4 (fsdp 4).

  python launch/run.py --config=configs/math_8b.py --config.model.checkpoint=/ckpt/Qwen3-8B \
      --config.data.path=/data/math_train.jsonl --config.workdir=/runs/math_8b
"""

from jaxrl_async.cli.config_file import sibling

base = sibling(__file__, "base")


def get_config(layout: str = "v5p"):
    c = base.get_config()
    c.workdir = ""
    # Compiled programs kept between runs: a restart or resume loads them instead of compiling for minutes.
    # A local directory: each sampler host keeps its own programs; a bucket ("gs://...") instead gives every
    # trainer host process 0's entries (JAX writes from process 0 only), and sampler hosts then compile.
    c.compile_cache_dir = "~/.cache/jaxrl_async/xla"
    c.mode = "async"
    c.max_staleness = 4
    c.total_steps = 500
    c.prompts_per_step = 64
    c.samples_per_prompt = 16
    c.tokenizer = ""  # the checkpoint's tokenizer.json and chat template
    c.eval_every = 25
    c.eval_prompts = 500
    c.checkpoint_every = 25

    c.model.preset = ""  # shapes come from the checkpoint's config.json
    c.model.checkpoint = ""  # REQUIRED: local HF directory (config.json, tokenizer, safetensors)
    c.model.dtype = "bfloat16"  # compute and the sampler's weights
    c.model.param_dtype = "float32"  # the trainer's master weights and AdamW state

    # Long context: completions of up to 27,648 tokens after prompts of up to 1,024 (AReaL's boba math
    # setting); a trainer row (token_budget) must hold the longest sequence. Sizes checked with
    # jaxrl-plan-check (compiled train step and sampler programs per device; docs/performance-model.md).
    if layout == "v5p":
        # One replica per host: a v5p host has 4 chips (launch/tpu_pod.sh: v5p-N counts TensorCores, two
        # per chip), and a replica of 4 chips holds Qwen3-8B with KV heads split over tensor=4. Twelve
        # such replicas keep the plan-checked per-chip load of one 48-chip (12, 4) replica (64 slots per
        # data shard: 75.6 GiB of 95 at 28k positions, jaxrl-plan-check --hardware tpu-v5p) and need
        # no collective between hosts while decoding. The trainer keeps 16 chips on 4 hosts: (16, 1)
        # compiled to ~166 GiB/chip of temporaries at 8k-token rows, (8, 2) to 37.8 GiB at 32k.
        c.mesh.sampler = (1, 4)
        c.mesh.sampler_replicas = 12
        c.mesh.trainer = (8, 2)
        c.mesh.devices_per_process = 4  # roles derive from it: processes 0-3 train, 4-15 sample
        c.sampler.num_slots = 64  # per replica: 768 in flight over the 12
        c.eval_slots = 5  # actor 0's greedy engine: the 5 per data shard of the 48-chip plan
        c.trainer.rows_per_micro = 8  # one 32k-token row per fsdp shard per micro-batch
    elif layout == "h100":
        # Sized so that each role leaves the plan check's 8% margin of the 68.5 GiB JAX may use on an
        # 80 GB GPU under launch/gpu_node.sh (XLA_PYTHON_CLIENT_MEM_FRACTION=0.92); see the trainer's row
        # length at the end of this function. Qwen3-8B, per GPU: trainer 62.4 GiB, sampler 60.0 GiB.
        # Re-planned with the split model (jaxrl-plan-check prints it: perf.balance, from the H200's
        # measured decode and train figures, docs/history/benchmarks.md "First run on an H200"). The
        # trainer keeps 4 of the 8 GPUs, the least its memory allows (fp32 masters and AdamW: 15.3 + 15.3
        # GiB a GPU at (2, 2)), so the lever is the sampler's decode batch: at 7 sequences a GPU (every
        # slot reserved at full length) the run was predicted sampler-bound by 6.0x on the plan check's
        # default length mix, at 64 a GPU by 1.4x (docs/performance-model.md).
        c.mesh.sampler = (4, 1)
        c.mesh.trainer = (2, 2)  # (4, 1) with 4 rows needed ~71 of 75 GiB at 8k-token rows: too tight
        # 64 sequences a GPU, the batch the device check's bar measures. The paged cache (the GPU default)
        # takes pages as sequences grow, so the slots no longer reserve full length: token_budget keeps the
        # KV memory the plan check passed before (28 full-length sequences, 172,032 positions = 23.6 GiB a
        # GPU), and when long sequences fill it the youngest is preempted and restarted (docs/sampler.md).
        c.sampler.num_slots = 256
        c.sampler.token_budget = 28 * 24576
        # Evaluation: more eval slots, not a bounded or skipped one. With 1 slot a GPU, 500 greedy prompts
        # were predicted to take 12 min at the plan check's default mean length, 91 min at a 4,000-token
        # median and 9 h if every completion ran to 23,552 tokens, at ~40% of the sampler's device time
        # (the eval engine alternates calls with it). 16 a GPU cut it up to 16x: the eval engine's pages
        # are its slots x the sampler's positions a slot, 64 x 2,688 = 43,008 a GPU (5.9 GiB), room for one
        # full-length sequence and ~20 typical ones (long ones: the pages, not the slots, bound it). 256
        # prompts (+-3% on pass@1) halve it again: minutes at the mean length, about an hour if every
        # completion ran to the limit. Version 0 is still evaluated: the baseline every later accuracy is
        # read against.
        c.eval_slots = 64
        c.eval_prompts = 256
        # The eval engine shares the sampler's weights: a copy of its own would add 15 GiB per GPU (the
        # (4, 1) sampler replicates Qwen3-8B's weights on each).
        c.eval_weights = "shared"
        c.trainer.rows_per_micro = 2
    else:
        raise ValueError(f"math_8b: unknown layout {layout!r} (v5p, h100)")
    c.mesh.fake_cpu_devices = 1  # accelerator layouts: check on CPU with jaxrl-plan-check

    c.data.task = "jsonl"
    c.data.path = ""  # REQUIRED: JSONL with "prompt" and "answer" fields (see data.prompt_field/answer_field)
    c.data.template = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
    c.data.use_chat_template = True
    c.data.num_epochs = None
    c.data.max_prompt_tokens = 1024
    c.reward.num_workers = 16
    c.reward.timeout_s = 10.0

    c.sampler.max_prompt_len = 1024
    c.sampler.max_new_tokens = 27648
    c.sampler.prompt_buckets = (256, 512, 1024)
    c.sampler.steps_per_call = 16
    c.sampler.temperature = 1.0
    c.sampler.update_mode = "keep_kv"

    c.trainer.loss = "decoupled_ppo"
    c.trainer.advantage = "grpo"
    c.trainer.lr = 1e-6
    c.trainer.warmup_steps = 10
    c.trainer.token_budget = 32768  # one row holds the longest prompt + completion (28,672 tokens)
    # Several optimizer updates per batch (AReaL's ppo_n_minibatches=4): with one, pi_prox equals
    # pi_theta and decoupled PPO's clip never binds.
    c.trainer.minibatches = 4
    c.trainer.compute_dtype = "bfloat16"
    c.trainer.remat = True
    if layout == "h100":
        # Completions of up to 23,552 tokens and rows exactly as long as the longest sequence (1,024 +
        # 23,552 = 24,576 positions; a multiple of the 4,096-position logits chunk and of the attention
        # blocks). cuDNN's packed attention holds a float32 backward workspace that grows with the row
        # (measured on an H200, model.attention.cudnn_workspace_bytes): 28,672-position rows with it need
        # 66.3 GiB per trainer GPU of the 68.5 usable, 3.3% headroom, under the plan check's margin.
        c.sampler.max_new_tokens = 23552
        c.trainer.token_budget = 24576
    return c
