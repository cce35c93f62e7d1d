"""configs/tiny_arith.py with LoRA: rank-8 adapters on every projection of the frozen warm-started base.

Only the adapters are trained (float32 masters and AdamW state: 233 kB against the model's 2.45 MB
here) and each policy version moves only them to the sampler (docs/lora.md). The learning rate is
about 7x the full run's (3e-4), as LoRA usually needs: the update is confined to a rank-8 subspace
scaled by alpha / rank = 2. Not tuned (one short comparison in docs/lora.md). Same as

  --config=configs/tiny_arith.py --config.trainer.lora.enabled=True --config.trainer.lr=2e-3
"""

from jaxrl_async.cli.config_file import sibling

tiny_arith = sibling(__file__, "tiny_arith")


def get_config():
    c = tiny_arith.get_config()
    c.workdir = "runs/tiny_arith_lora"
    c.trainer.lora.enabled = True
    c.trainer.lora.rank = 8
    c.trainer.lora.alpha = 16.0
    c.trainer.lr = 2e-3
    return c
