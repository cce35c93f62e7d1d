"""LoRA adapters as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).

`peft.PeftModel.from_pretrained(base, DIR)` loads it onto the base exported by `save_hf` (the unmerged
policy). Names and orientation are PEFT's: `base_model.model.<module>.lora_A.weight` [r, in] and
`lora_B.weight` [out, r], B unscaled (PEFT multiplies by lora_alpha / r, as `model.lora.combine` does).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from jaxrl_async.model.config import ModelConfig
from jaxrl_async.model.hf import write_safetensors
from jaxrl_async.model.lora import LoraConfig

# Our projection -> its Hugging Face module under model.layers.{l}.
HF_MODULES = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
}  # fmt: skip


def peft_config(lora: LoraConfig, base_model: str = "") -> dict:
    """adapter_config.json: plain LoRA (no rsLoRA, DoRA or dropout at inference)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": int(lora.rank),
        "lora_alpha": float(lora.alpha),
        "lora_dropout": 0.0,
        "target_modules": sorted(HF_MODULES[t].split(".")[1] for t in lora.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_peft(cfg: ModelConfig, lora: LoraConfig, adapters: dict, path: str, base_model: str = "") -> None:
    """Writes `adapters` ({"layers": {t_lora_a, t_lora_b}}, any placement) as a PEFT adapter directory."""
    tensors, shapes = {}, {}
    for t in lora.targets:
        a = np.asarray(jax.device_get(adapters["layers"][f"{t}_lora_a"]), np.float32)  # [L, *in, r]
        b = np.asarray(jax.device_get(adapters["layers"][f"{t}_lora_b"]), np.float32)  # [L, r, *out]
        for i in range(cfg.n_layers):
            prefix = f"base_model.model.model.layers.{i}.{HF_MODULES[t]}"
            a_rxin = a[i].reshape(-1, lora.rank).T
            b_outxr = b[i].reshape(lora.rank, -1).T
            for name, x in ((f"{prefix}.lora_A.weight", a_rxin), (f"{prefix}.lora_B.weight", b_outxr)):
                tensors[name], shapes[name] = (lambda x=x: x), x.shape
    os.makedirs(path, exist_ok=True)
    write_safetensors(os.path.join(path, "adapter_model.safetensors"), tensors, shapes,
                      dict.fromkeys(tensors, np.float32))  # fmt: skip
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(peft_config(lora, base_model), f, indent=2)
