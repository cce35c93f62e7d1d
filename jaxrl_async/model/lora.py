"""Low-rank adapters (LoRA), declared like every other parameter: ParamSpecs with logical axes.

An adapter on projection `t` (q, k, v, o, gate, up, down) of weight W [L, *in, *out] adds two leaves to
the layer tree, `t_lora_a` [L, *in, r] and `t_lora_b` [L, r, *out]; the layer computes
x·W + (x·A)·(s·B) with s = alpha / r (the model's `EINSUM` projections look for the two leaves, so the
trainer's forward is the unmerged form and never builds W + s·A·B). `merge` writes W + s·A·B into a copy
of the base (what the sampler runs after a version in "merge" mode; what the Hugging Face export writes).

Why our own and not Qwix: Qwix (0.1.8 imports fine with jax 0.10.2) adds LoRA by intercepting the
`dot_general`s of Flax (nnx / linen) modules and creates the adapter parameters at trace time, inside the
module. This model is plain functions over a ParamSpec tree, abstract-first (shardings, checkpoints,
weight sync and the sampler's decode layout all derive from the declaration): interception would put a
second, implicit declaration beside it, and would not reach the sampler's own decode layout at all.
Declared here, adapters get shardings, checkpoint targets and sync layouts from the same code as the base.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxrl_async.model.config import ModelConfig
from jaxrl_async.model.params import ParamSpec, param_specs

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# "zero_b": A ~ truncated normal (std 1/sqrt(fan-in)), B = 0, so training starts exactly at the base
# (PEFT's default, up to A's distribution). "normal": B normal as well (starts away from the base; tests).
INITS = ("zero_b", "normal")
ADAPTER_DTYPE = "float32"  # the adapters' master weights and AdamW moments
_FIELD = "config.trainer.lora"


def _contract(target: str) -> int:
    """How many leading (after [L]) dims of the target's weight are its input: o is [L, H, K, D]."""
    return 2 if target == "o" else 1


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """config.trainer.lora: low-rank adapters instead of full fine-tuning (enabled=False: full, unchanged).

    Attributes:
      enabled: train adapters only; the base is frozen in the compute dtype (no gradient, no AdamW state).
      rank: r, the adapters' inner dimension (>= 1, at most each target's input and output width).
      alpha: the update is scaled by alpha / rank (PEFT's lora_alpha).
      targets: the projections that get adapters (of TARGETS).
      init: one of INITS.
    """

    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = TARGETS
    init: str = "zero_b"

    def __post_init__(self):
        if isinstance(self.targets, str | list):  # from a command line or a config dict
            targets = self.targets.split(",") if isinstance(self.targets, str) else self.targets
            object.__setattr__(self, "targets", tuple(t.strip() for t in targets))
        if int(self.rank) < 1:
            raise ValueError(f"{_FIELD}.rank must be >= 1, got {self.rank}")
        if not self.targets:
            raise ValueError(f"{_FIELD}.targets is empty (choose from {TARGETS})")
        for t in self.targets:
            if t not in TARGETS:
                raise ValueError(f"{_FIELD}.targets: {t!r} is not a projection of the model ({TARGETS})")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"{_FIELD}.targets lists a projection twice: {self.targets}")
        if not self.alpha > 0:
            raise ValueError(f"{_FIELD}.alpha must be > 0, got {self.alpha}")
        if self.init not in INITS:
            raise ValueError(f"{_FIELD}.init={self.init!r} not in {INITS}")

    @property
    def scale(self) -> float:
        return float(self.alpha) / int(self.rank)

    def check_model(self, cfg: ModelConfig) -> None:
        """Raises ValueError naming the field when the rank exceeds a target's input or output width (the
        update would not be low-rank: a full-rank A·B costs more than the weight it adapts)."""
        layer = param_specs(cfg)["layers"]
        for t in self.targets:
            shape = layer[t].shape[1:]
            c = _contract(t)
            d_in, d_out = math.prod(shape[:c]), math.prod(shape[c:])
            if self.rank > min(d_in, d_out):
                raise ValueError(
                    f"{_FIELD}.rank={self.rank} exceeds target {t!r}'s dims (in {d_in}, out {d_out})"
                )


def adapter_specs(cfg: ModelConfig, lora: LoraConfig) -> dict:
    """The adapters' ParamSpec tree, {"layers": {t_lora_a, t_lora_b, ...}}: the trainer's trainable tree."""
    lora.check_model(cfg)
    layer = param_specs(cfg)["layers"]
    out = {}
    for t in lora.targets:
        s, c, r = layer[t], _contract(t), lora.rank
        in_shape, out_shape = s.shape[1 : 1 + c], s.shape[1 + c :]
        in_axes, out_axes = s.logical_axes[1 : 1 + c], s.logical_axes[1 + c :]
        # The rank axis is never sharded (r is small); the others shard like the weight they adapt.
        out[f"{t}_lora_a"] = ParamSpec(
            (s.shape[0], *in_shape, r), ADAPTER_DTYPE, ("layers", *in_axes, None), "normal",
            math.prod(in_shape),
        )  # fmt: skip
        b_init = "normal" if lora.init == "normal" else "zeros"
        out[f"{t}_lora_b"] = ParamSpec(
            (s.shape[0], r, *out_shape), ADAPTER_DTYPE, ("layers", None, *out_axes), b_init, r
        )
    return {"layers": out}


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def init_adapters(cfg: ModelConfig, lora: LoraConfig, key, shardings=None) -> dict:
    """Fresh adapters (float32), created in `shardings` when given."""
    specs = adapter_specs(cfg, lora)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)

    def make(key):
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(treedef, [s.initialize(keys[i]) for i, s in enumerate(leaves)])

    return jax.jit(make, out_shardings=shardings)(key)


def combine(base: dict, adapters: dict, lora: LoraConfig) -> dict:
    """The model's parameter tree with the adapters beside the base (B pre-scaled by alpha / r), for the
    unmerged forward. Differentiable in `adapters`; the base's leaves are passed through untouched."""
    scaled = {
        name: x * jnp.asarray(lora.scale, x.dtype) if name.endswith("_lora_b") else x
        for name, x in adapters["layers"].items()
    }
    return {**base, "layers": {**base["layers"], **scaled}}


def delta(a, b, target: str):
    """A·B of one target over all layers, float32 [L, *in, *out]."""
    c = _contract(target)
    n, r = a.shape[0], a.shape[-1]
    in_shape, out_shape = a.shape[1 : 1 + c], b.shape[2:]
    a_LxIxR = a.astype(jnp.float32).reshape(n, -1, r)
    b_LxRxO = b.astype(jnp.float32).reshape(n, r, -1)
    return jnp.einsum("lir,lro->lio", a_LxIxR, b_LxRxO).reshape(n, *in_shape, *out_shape)


def merge(base: dict, adapters: dict, lora: LoraConfig) -> dict:
    """The base with W + (alpha / r)·A·B written into each target, in the base's dtype (summed in
    float32, rounded once): the sampler's weights of a version in "merge" mode, and the export's."""
    layers = dict(base["layers"])
    for t in lora.targets:
        w = layers[t]
        d = delta(adapters["layers"][f"{t}_lora_a"], adapters["layers"][f"{t}_lora_b"], t)
        layers[t] = (w.astype(jnp.float32) + lora.scale * d).astype(w.dtype)
    return {**base, "layers": layers}


def adapter_params(cfg: ModelConfig, lora: LoraConfig) -> int:
    """How many numbers the adapters hold (every layer, every target)."""
    return sum(math.prod(s.shape) for s in jax.tree.leaves(adapter_specs(cfg, lora), is_leaf=_is_spec))


def adapter_bytes(cfg: ModelConfig, lora: LoraConfig, dtype: str | None = None) -> int:
    """Bytes of one copy of the adapters (in `dtype`, default their float32 masters)."""
    return adapter_params(cfg, lora) * jnp.dtype(dtype or ADAPTER_DTYPE).itemsize
