"""Which weight publisher a trainer process gets and which receiver a sampler process gets: one process or
several, full fine-tuning or LoRA (config.trainer.lora: the base once, then adapters only; lora_sync.py).
"""

from __future__ import annotations

from jaxrl_async.runtime.lora_sync import LoraPublisher, LoraReceiver, LoraWeights
from jaxrl_async.runtime.weight_sync import (
    LocalWeights,
    TransferPublisher,
    TransferReceiver,
    WeightSync,
    sampler_dtype,
)


def trainer_publisher(run, cluster, model_cfg, t_mesh, s_mesh, frozen, targets: dict):
    """(publisher, the one process's receiver or None). `s_mesh`: this process's sampler mesh (one process
    only); `frozen`: the train state's frozen base (LoRA); `targets`: `TransferPublisher`'s."""
    roles = cluster.roles
    lora = run.trainer.lora if run.trainer.lora.enabled else None
    if not roles.multi:
        if lora:  # the base moves once, now; each version moves only the adapters
            weights = LoraWeights(model_cfg, lora, s_mesh, frozen, run.verify_weights, run.sampler.lora_apply)
        else:
            sync = WeightSync(model_cfg, s_mesh, dtype=sampler_dtype(model_cfg))
            weights = LocalWeights(sync, run.verify_weights)
        return weights, weights
    pulls, shape = sum(map(len, roles.replicas)), tuple(run.mesh.sampler)
    transport = run.mesh.weight_transport
    if lora:  # the base with the first version, once; then only the adapters
        return LoraPublisher(cluster, model_cfg, lora, t_mesh, shape, pulls, frozen, run.verify_weights,
                             transport, targets), None  # fmt: skip
    publisher = TransferPublisher(cluster, model_cfg, t_mesh, shape, sampler_dtype(model_cfg), pulls,
                                  run.verify_weights, targets=targets, transport=transport)  # fmt: skip
    return publisher, None


def sampler_receiver(run, cluster, model_cfg, t_mesh, s_mesh, pull: int):
    """The receiver of a sampler process (or replica member) of a multi-process run; `pull`: its index."""
    if run.trainer.lora.enabled:
        return LoraReceiver(cluster, pull, model_cfg, run.trainer.lora, t_mesh, s_mesh, run.verify_weights,
                            run.sampler.lora_apply, run.mesh.weight_transport)  # fmt: skip
    return TransferReceiver(cluster, pull, model_cfg, t_mesh, s_mesh, sampler_dtype(model_cfg),
                            transport=run.mesh.weight_transport)  # fmt: skip
