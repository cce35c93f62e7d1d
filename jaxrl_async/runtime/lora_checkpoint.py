"""What a LoRA run (config.trainer.lora) keeps beside its checkpoints, and how a policy is read back.

Each step holds what it trains, as in a full run: the adapters (the state's `params`) and their AdamW
state, so a resume is exact. The frozen base is the same for every step: it is written once, to
`lora_base/` beside the steps, and `lora.json` records the LoRA config and that reference. A policy is
then base + adapters (`load_lora_policy`); `checkpoint.load_policy` merges them (export, generate, eval).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl_async import storage
from jaxrl_async.model import abstract_params
from jaxrl_async.model import lora as lora_lib
from jaxrl_async.model.params import ParamSpec
from jaxrl_async.sharding import tree_shardings

LORA_FILE = "lora.json"
BASE_DIR = "lora_base"


def is_lora(directory: str) -> bool:
    return storage.exists(storage.join(directory, LORA_FILE))


def save_base(directory: str, lora: lora_lib.LoraConfig, frozen, source: str, processes=None) -> None:
    """Writes the frozen base once (a resumed run finds it there) and lora.json; `source` says where the
    base came from (an HF checkpoint, the warm start or the seeded init), for people. `processes`: the
    trainer processes of a multi-process run, the only ones that take part (None: every process)."""
    base_dir = storage.join(directory, BASE_DIR)
    if not storage.exists(base_dir):
        mp = ocp.options.MultiprocessingOptions(
            primary_host=0,
            active_processes=None if processes is None else set(processes),
            barrier_sync_key_prefix=None if processes is None else "trainers_lora_base",
        )
        handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=mp)
        # orbax refuses arrays one process holds whole in a multi-process run (checkpoint._host_local)
        host_local = lambda x: jax.process_count() > 1 and x.is_fully_addressable  # noqa: E731
        frozen = jax.tree.map(lambda x: np.asarray(x) if host_local(x) else x, frozen)
        ocp.Checkpointer(handler, multiprocessing_options=mp).save(base_dir, frozen)
    if processes is None or jax.process_index() == min(processes):
        info = {"lora": dataclasses.asdict(lora), "base": BASE_DIR, "base_source": source}
        storage.write_text(storage.join(directory, LORA_FILE), json.dumps(info, indent=1))


def load_lora_policy(directory: str, model_cfg, mesh, rules, step: int):
    """(lora config, base, adapters) of checkpoint `step`, laid out by `rules` on `mesh`."""
    info = json.loads(storage.read_text(storage.join(directory, LORA_FILE)))
    lora = lora_lib.LoraConfig(**info["lora"])
    base_dir = storage.join(directory, info["base"])
    meta = ocp.PyTreeCheckpointer().metadata(base_dir)
    tree = getattr(meta, "item_metadata", None) or getattr(meta, "tree", None) or meta
    dtype = jax.tree.leaves(tree)[0].dtype  # the base was saved in the run's compute dtype
    base_target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding),
                               abstract_params(model_cfg, mesh, rules))  # fmt: skip
    base = _restore(base_dir, base_target)
    specs = lora_lib.adapter_specs(model_cfg, lora)
    sh = tree_shardings(specs, mesh, rules)
    target = {"params": jax.tree.map(lambda s, x: s.abstract(x), specs, sh,
                                     is_leaf=lambda x: isinstance(x, ParamSpec))}  # fmt: skip
    adapters = _restore(storage.join(directory, str(step), "state"), target, partial=True)["params"]
    return lora, base, adapters


def _restore(path: str, target, partial: bool = False):
    return ocp.PyTreeCheckpointer().restore(
        path,
        args=ocp.args.PyTreeRestore(
            item=target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=partial,
        ),
    )
