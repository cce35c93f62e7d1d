"""Model configuration: a frozen dataclass, read from and written to Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from typing import Any

_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_HF_ARCH = {v: k for k, v in _ARCHS.items()}
_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
DTYPES = ("float32", "bfloat16")
# Training and prefill attention (jaxrl_async.model.attention): "auto" picks by platform.
ATTENTION = ("auto", "reference", "dot_product", "blocked", "splash")
# Targets the kernels may be chosen for (ModelConfig.platform); "" = the devices the program runs on.
PLATFORMS = ("", "cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling: "linear" (divide by factor) or "llama3" (Llama 3.1 long-context scheme)."""

    kind: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.kind not in ("linear", "llama3"):
            raise ValueError(f"rope_scaling.rope_type={self.kind!r} is not supported (linear, llama3)")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer (Llama 3.x, Qwen2/2.5, Qwen3).

    Attributes are static: changing any of them recompiles.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffw_size: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: biases on q, k, v projections.
    o_bias: bool = False  # Llama attention_bias=True also puts a bias on o_proj.
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE.
    # With qk_norm: one RMSNorm over all heads of a position's q (and one over its k) instead of one per head,
    # as OLMo 2 (whose other differences, post-norms, are not modelled): no Hugging Face export.
    qk_norm_all_heads: bool = False
    max_seq_len: int = 4096
    dtype: str = "float32"  # compute dtype of activations and matmuls
    param_dtype: str = "float32"  # storage dtype of the weights (the trainer's master copy)
    attention: str = "auto"  # training / prefill attention implementation (one of ATTENTION)
    # The platform every kernel choice is made for (attention "auto", the sampler's "auto" kernels, the paged
    # kernel): "" = JAX's default backend, the devices the program runs on. A plan check or a lowering test
    # names its target ("gpu", "tpu") and builds the programs on CPU devices as that target would run them.
    platform: str = ""
    arch: str = "llama"  # which HF architecture to export as
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffw_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} not in {DTYPES}")
        if self.attention not in ATTENTION:
            raise ValueError(f"ModelConfig.attention={self.attention!r} not in {ATTENTION}")
        if self.platform not in PLATFORMS:
            raise ValueError(f"ModelConfig.platform={self.platform!r} not in {PLATFORMS}")
        if self.qk_norm_all_heads and not self.qk_norm:
            raise ValueError("ModelConfig.qk_norm_all_heads=True needs qk_norm=True")
        if self.arch not in _HF_ARCH:
            raise ValueError(f"ModelConfig.arch={self.arch!r} not in {sorted(_HF_ARCH)}")

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, f, h, g, k, v = (
            self.d_model,
            self.ffw_size,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            self.vocab_size,
        )
        per_layer = d * h * k + 2 * d * g * k + h * k * d + 3 * d * f + 2 * d
        per_layer += (h * k + 2 * g * k) * self.qkv_bias + d * self.o_bias
        per_layer += ((h + g) * k if self.qk_norm_all_heads else 2 * k) * self.qk_norm
        return v * d * (1 if self.tie_embeddings else 2) + self.n_layers * per_layer + d

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    def compute_copy(self) -> ModelConfig:
        """This model with its weights stored in the compute dtype: the layout of a copy cast from the
        master weights (the sampler's bf16 weights of an fp32-master run)."""
        return self if self.param_dtype == self.dtype else self.replace(param_dtype=self.dtype)


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Reads RoPE settings from transformers-4 (`rope_theta`, `rope_scaling`) or -5 (`rope_parameters`)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or None
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is None and params:
        scaling = params
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind not in ("linear", "llama3"):
        raise ValueError(
            f"config.json: rope_scaling rope_type={kind!r} is not supported (default, linear, llama3)"
        )
    kw = {"kind": kind, "factor": float(scaling["factor"])}
    if kind == "llama3":
        kw.update(
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    return float(theta), RopeScaling(**kw)


def from_hf_config(
    hf: dict[str, Any], dtype: str = "float32", param_dtype: str = "float32", attention: str = "auto"
) -> ModelConfig:
    """A ModelConfig from a parsed HF config.json; unknown architectures fail naming the field.

    `dtype` is the compute dtype; `param_dtype` the storage dtype of the weights read (float32 master
    weights by default, whatever the checkpoint's own dtype); `attention` as ModelConfig.attention.
    """
    archs = hf.get("architectures") or []
    arch = next((_ARCHS[a] for a in archs if a in _ARCHS), None)
    if arch is None:
        arch = _MODEL_TYPE.get(hf.get("model_type", ""))
    if arch is None:
        raise ValueError(
            f"config.json: architectures={archs} / model_type={hf.get('model_type')!r} is not supported "
            f"(supported: {sorted(_ARCHS)})"
        )
    for field in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
    ):
        if field not in hf:
            raise ValueError(f"config.json: missing field {field!r}")
    if hf.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true is not supported")
    theta, scaling = _rope_from_hf(hf)
    n_heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    attention_bias = bool(hf.get("attention_bias", False))
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        d_model=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(head_dim),
        ffw_size=int(hf["intermediate_size"]),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or attention_bias,
        o_bias=arch != "qwen2" and attention_bias,
        qk_norm=arch == "qwen3",
        max_seq_len=int(hf.get("max_position_embeddings", 4096)),
        dtype=dtype,
        param_dtype=param_dtype,
        attention=attention,
        arch=arch,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
    )


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A config.json dict that transformers loads (transformers-4 field names, read by 4 and 5)."""
    if cfg.arch == "qwen2" and (cfg.o_bias or not cfg.qkv_bias):
        raise ValueError("Qwen2 export needs qkv_bias=True and o_bias=False")
    if cfg.arch == "llama" and cfg.qkv_bias != cfg.o_bias:
        raise ValueError("Llama export needs qkv_bias == o_bias (attention_bias)")
    if cfg.qk_norm_all_heads:
        raise ValueError(
            "no supported Hugging Face architecture has qk_norm_all_heads=True; export needs False"
        )
    hf: dict[str, Any] = {
        "architectures": [_HF_ARCH[cfg.arch]],
        "model_type": _MODEL_TYPE[cfg.arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffw_size,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "torch_dtype": cfg.param_dtype,
    }
    if cfg.arch != "qwen2":
        hf["attention_bias"] = cfg.o_bias
    if cfg.bos_token_id is not None:
        hf["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        hf["eos_token_id"] = cfg.eos_token_id
    s = cfg.rope_scaling
    if s is not None:
        hf["rope_scaling"] = {"rope_type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            hf["rope_scaling"].update(
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position_embeddings,
            )
    return hf
