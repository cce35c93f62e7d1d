"""The staleness study's cell (tools/eta_sweep.py): configs/tiny_arith.py in AReaL's setting.

Four minibatch updates per batch (AReaL's ppo_n_minibatches), so pi_prox is the policy before the step's
first update and decoupled PPO's clip bounds the later updates against it; at one update per batch the
decoupled objective has no trust region at all (docs/benchmarks.md). With the sampler on a core of its
own it idles most of the time, so admission runs the full eta ahead and head staleness approaches eta.
The sweep overrides max_staleness / mode, trainer.loss, seed and total_steps per cell.
"""

from jaxrl_async.cli.config_file import sibling

tiny_arith = sibling(__file__, "tiny_arith")


def get_config():
    c = tiny_arith.get_config()
    c.workdir = "runs/eta_sweep"
    c.total_steps = 200
    # Half the demo's batch: 32 prompts x 8 samples, four updates of 8 prompts each; the cells are
    # CPU-bound and a smaller batch buys more steps per minute.
    c.prompts_per_step = 32
    c.eval_every = 20
    c.eval_prompts = 400  # standard error ~0.025 near 50%
    c.text_samples = 0
    c.checkpoint_every = 0  # only the final checkpoint: cells are short
    c.checkpoint_minutes = 0.0

    c.trainer.minibatches = 4
    c.trainer.total_steps = 1000  # the demo's schedule: the cells are its first total_steps steps
    # A whole batch decodes at once. The sampler outpaces the four-update trainer only on a core of its
    # own (tools/eta_sweep.py --processes_per_cell 2): sharing one core, eta = 4 reached a head
    # staleness of 2 at most.
    c.sampler.num_slots = 256
    return c
