"""Model shape for the performance model: parameter bytes, FLOPs and KV-cache bytes per token."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the performance model needs to know about a decoder-only transformer.

    Attributes:
      params: total parameter count (all experts of an MoE; this is what sits in memory).
      n_layers: transformer blocks.
      d_model: residual width.
      n_heads: query heads.
      n_kv_heads: key/value heads (GQA).
      head_dim: width of one head.
      vocab_size: vocabulary size (only used for reporting).
      active_params: parameters touched per token (MoE: shared + top-k experts); defaults to `params`.
      param_bytes: bytes per stored weight (2 for bf16/fp16).
      kv_bytes: bytes per cached K or V element.
      trainable_params: parameters the trainer updates: a LoRA run's adapters (config.trainer.lora,
        `model.lora.adapter_params`); None: all of them (full fine-tuning). With it a version moves only
        those (`sync_bytes`) and the trainer holds the rest frozen (`train_state_bytes`).
    """

    params: float
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int = 0
    active_params: float | None = None
    param_bytes: int = 2
    kv_bytes: int = 2
    trainable_params: float | None = None

    def __post_init__(self):
        for name in ("params", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelShape.{name} must be > 0, got {getattr(self, name)}")
        if self.active_params is not None and not 0 < self.active_params <= self.params:
            raise ValueError(f"ModelShape.active_params={self.active_params} must be in (0, params]")
        if self.param_bytes <= 0 or self.kv_bytes <= 0:
            raise ValueError("ModelShape.param_bytes and kv_bytes must be > 0")
        if self.trainable_params is not None and not 0 < self.trainable_params <= self.params:
            raise ValueError(f"ModelShape.trainable_params={self.trainable_params} must be in (0, params]")

    @property
    def n_active(self) -> float:
        """Parameters used per token."""
        return self.params if self.active_params is None else self.active_params

    @property
    def weight_bytes(self) -> float:
        """Bytes of all weights (what one decode step streams from memory at small batch)."""
        return self.params * self.param_bytes

    @property
    def sync_bytes(self) -> float:
        """Bytes one policy version moves to a sampler replica: the trained parameters (LoRA: the
        adapters; the frozen base moved once, at start), in the sampler's dtype."""
        trained = self.params if self.trainable_params is None else self.trainable_params
        return trained * self.param_bytes

    def train_state_bytes(self, bytes_per_trained_param: float) -> float:
        """Trainer memory for the weights and optimizer: `bytes_per_trained_param` (master copy, gradient,
        AdamW moments) for every trained parameter, plus, with LoRA, the frozen base at param_bytes."""
        if self.trainable_params is None:
            return self.params * bytes_per_trained_param
        return self.params * self.param_bytes + self.trainable_params * bytes_per_trained_param

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes one token of context occupies (K and V, all layers)."""
        return 2.0 * self.n_layers * self.n_kv_heads * self.head_dim * self.kv_bytes

    def attn_flops_per_token(self, context: float) -> float:
        """Forward attention FLOPs (QK^T and AV) for one query token over `context` keys."""
        return 4.0 * self.n_layers * self.n_heads * self.head_dim * context

    def decode_flops_per_token(self, context: float) -> float:
        """Forward FLOPs to decode one token at the given context length."""
        return 2.0 * self.n_active + self.attn_flops_per_token(context)

    def train_flops_per_token(self, seq_len: float, extra_forwards: int = 0) -> float:
        """FLOPs per trained token: forward + backward + `extra_forwards` forward passes.

        Causal attention sees seq_len/2 keys on average. `extra_forwards` counts e.g. the recomputed
        proximal log-probs of decoupled PPO or a reference model. The backward of a full fine-tune is
        twice the forward (gradients of the activations and of the weights). A LoRA run's frozen base has
        no weight gradients: its matmuls' backward is one forward's worth, attention's still two, and the
        adapters cost 2 FLOPs a parameter forward and 4 backward.
        """
        matmuls, attn = 2.0 * self.n_active, self.attn_flops_per_token(seq_len / 2.0)
        fwd = matmuls + attn
        if self.trainable_params is None:
            return (3 + extra_forwards) * fwd
        return (1 + extra_forwards) * fwd + matmuls + 2.0 * attn + 6.0 * self.trainable_params

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (inverse of `shape_from_dict`)."""
        return dataclasses.asdict(self)


def shape_from_dict(d: dict[str, Any]) -> ModelShape:
    """ModelShape from a scenario's "model" section; unknown keys are an error."""
    fields = {f.name for f in dataclasses.fields(ModelShape)}
    unknown = set(d) - fields
    if unknown:
        raise ValueError(f"unknown model keys {sorted(unknown)}; expected a subset of {sorted(fields)}")
    return ModelShape(**d)


def shape_from_model_config(cfg: Any, param_bytes: int = 2, kv_bytes: int = 2, lora: Any = None
                            ) -> ModelShape:  # fmt: skip
    """ModelShape from a `jaxrl_async.model.config.ModelConfig`; `lora` (a model.lora.LoraConfig, enabled)
    makes the adapters the trained parameters."""
    params = cfg.num_params  # the model's own count (embeddings once when tied; biases and norms included)
    trainable = None
    if lora is not None and lora.enabled:
        from jaxrl_async.model.lora import adapter_params

        trainable = float(adapter_params(cfg, lora))
    return ModelShape(
        params=float(params),
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        param_bytes=param_bytes,
        kv_bytes=kv_bytes,
        trainable_params=trainable,
    )
