"""The sampler's device arrays, declared once and abstract-first: the decode weight layout and decode state.

Every leaf is a `ParamSpec` (shape, dtype, logical axes); shardings, the abstract arrays of a compile-only
engine, the empty decode state and the weight conversion all derive from these declarations.

Decode weight layout (`decode_layout`; `to_decode_layout` builds it once per weight update):
  - layers unstacked into a list: the decode step unrolls its layer loop, so every weight and cache buffer
    is static (the model's layer scan kept the whole [L, B, S, G, K] cache in its carry, and XLA:CPU copied
    cache slices every step: ~5x slower per decode step at batch 1 on llama_100m);
  - every matrix 2-D and output-major, [N_out, D_in]: XLA:CPU then contracts the weight's last axis in
    place. With multi-axis weights it inserted a transposing copy of the weight every step at batch 1, and
    with [in, out] weights its small-row matmuls were ~1.7x slower at batch 32 (measured);
  - with `fuse`, q|k|v in one matrix and gate|up in another (fewer, larger matmuls);
  - with `pack` (SamplerConfig.linear="cpu_kernel"), every matrix whose row count is a multiple of 16 in
    `cpu_kernels.pack` panels [N/16, D, 16];
  - every other parameter (embedding, norms, biases) as the model declares it, per layer, so a parameter
    added to `param_specs` reaches the decode layout without a line here.
The decode step computes with these weights through the model's own `layer`
(`jaxrl_async.sampler.decode.PROJECTIONS` does the matmuls).

Decode state (`DecodeState`, declared by `decode_state`): per layer the KV cache, slotted [B, G, S, K]
(head-major: attention is a plain batched matmul) or a page pool [G, pages, page_size, K] (`paged`), and per
slot its next token, position, last position, done flag and random key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_async.model import ModelConfig, ParamSpec, param_specs
from jaxrl_async.sampler import cpu_kernels

CACHE_AXES = ("batch", "kv_heads", "seq", "head_dim")  # a slotted K or V buffer [B, G, S, K]
POOL_AXES = ("kv_heads", "batch", None, "head_dim")  # a page pool [G, pages, page_size, K]; pages split over
# the data axis as the slots are (each data shard owns a contiguous range of pages and the slots using them)
PREFIX_AXES = (None, "kv_heads", "seq", "head_dim")  # prefilled keys/values [n, G, T, K]: replicated over
# the data axis (any slot may take any row)
_MATRICES = ("q", "k", "v", "o", "gate", "up", "down")  # layer weights that become 2-D output-major matrices


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One leaf of the decode layout: what it is and how it is made from the model's parameters.

    Attributes:
      spec: shape, dtype and logical axes.
      build: the model's parameters (top level, or one layer's slice without the [L] axis) -> the array.
      matrix: a linear weight [N_out, D_in], packed for the CPU kernel when N_out is a multiple of 16.
    """

    spec: ParamSpec
    build: Callable[[dict], jax.Array]
    matrix: bool = False

    def packed(self) -> Leaf:
        """This matrix in `cpu_kernels.pack` panels (the row axis keeps its name; panel lanes stay whole)."""
        n, d = self.spec.shape
        spec = dataclasses.replace(
            self.spec,
            shape=(n // cpu_kernels.PANEL, d, cpu_kernels.PANEL),
            logical_axes=(*self.spec.logical_axes, None),
        )
        return Leaf(spec, lambda src: cpu_kernels.pack(self.build(src)), matrix=True)


def _fused_qkv(cfg: ModelConfig, lp: dict):
    """[G * (R + 2) * K, D]: rows ordered (KV head, its R query heads + k + v, head dim), so sharding the row
    axis over "tensor" splits whole KV groups."""
    D, G, K = cfg.d_model, cfg.n_kv_heads, cfg.head_dim
    q_DxGxRxK = lp["q"].reshape(D, G, cfg.n_heads // G, K)
    qkv = jnp.concatenate([q_DxGxRxK, lp["k"][:, :, None], lp["v"][:, :, None]], axis=2)
    return qkv.reshape(D, -1).T


def _layer_leaves(cfg: ModelConfig, fuse: bool) -> dict[str, Leaf]:
    D, H, G, K, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffw_size
    R = H // G
    mat = lambda shape, axes, build: Leaf(ParamSpec(shape, cfg.param_dtype, axes), build, matrix=True)
    specs = param_specs(cfg)["layers"]
    leaves = {
        name: Leaf(
            dataclasses.replace(s, shape=s.shape[1:], logical_axes=s.logical_axes[1:]),
            lambda lp, n=name: lp[n],
        )
        for name, s in specs.items()
        if name not in _MATRICES
    }
    leaves["o"] = mat((D, H * K), ("embed", "q_heads"), lambda lp: lp["o"].reshape(H * K, D).T)
    leaves["down"] = mat((D, F), ("embed", "mlp"), lambda lp: lp["down"].T)
    if fuse:
        leaves["qkv"] = mat((G * (R + 2) * K, D), ("kv_heads", "embed"), lambda lp: _fused_qkv(cfg, lp))
        # Rows ordered (F, gate|up): sharding them over "tensor" splits whole MLP columns.
        gate_up = lambda lp: jnp.stack([lp["gate"], lp["up"]], axis=-1).reshape(D, 2 * F).T
        leaves["gate_up"] = mat((2 * F, D), ("mlp", "embed"), gate_up)
    else:
        leaves["q"] = mat((H * K, D), ("q_heads", "embed"), lambda lp: lp["q"].reshape(D, H * K).T)
        leaves["k"] = mat((G * K, D), ("kv_heads", "embed"), lambda lp: lp["k"].reshape(D, G * K).T)
        leaves["v"] = mat((G * K, D), ("kv_heads", "embed"), lambda lp: lp["v"].reshape(D, G * K).T)
        leaves["gate"] = mat((F, D), ("mlp", "embed"), lambda lp: lp["gate"].T)
        leaves["up"] = mat((F, D), ("mlp", "embed"), lambda lp: lp["up"].T)
    return leaves


# Per target: the decode layout's logical axis of its input and of its output (rows of the 2-D matrices).
_ADAPTER_AXES = {
    "q": ("embed", "q_heads"), "k": ("embed", "kv_heads"), "v": ("embed", "kv_heads"),
    "o": ("q_heads", "embed"), "gate": ("embed", "mlp"), "up": ("embed", "mlp"), "down": ("mlp", "embed"),
}  # fmt: skip


def _adapter_leaves(cfg: ModelConfig, lora) -> dict[str, Leaf]:
    """Unmerged LoRA adapters (SamplerConfig.lora_apply="unmerged"), output-major like the base's matrices:
    A as [r, in], B as [out, r] (B pre-scaled by alpha / r, `model.lora.combine`). Never fused or packed:
    they are thin, and a version replaces only them (`Engine.update_adapters`)."""
    out = {}
    for t in lora.targets:
        a_in, a_out = _ADAPTER_AXES[t]
        a_name, b_name = f"{t}_lora_a", f"{t}_lora_b"
        spec = lambda shape, axes: ParamSpec(shape, cfg.param_dtype, axes)
        n_in = lambda lp, n=a_name: math.prod(lp[n].shape[:-1])
        out[a_name] = Leaf(
            spec((lora.rank, _width(cfg, a_in)), (None, a_in)),
            lambda lp, n=a_name, f=n_in: lp[n].reshape(f(lp), -1).T.astype(cfg.param_dtype),
        )
        out[b_name] = Leaf(
            spec((_width(cfg, a_out), lora.rank), (a_out, None)),
            lambda lp, n=b_name: lp[n].reshape(lp[n].shape[0], -1).T.astype(cfg.param_dtype),
        )
    return out


def _width(cfg: ModelConfig, axis: str) -> int:
    return {"embed": cfg.d_model, "q_heads": cfg.n_heads * cfg.head_dim, "mlp": cfg.ffw_size,
            "kv_heads": cfg.n_kv_heads * cfg.head_dim}[axis]  # fmt: skip


def decode_layout(cfg: ModelConfig, fuse: bool, pack: bool = False, lora=None) -> dict:
    """The decode layout as a tree of `Leaf`s: {top-level names, "layers": [per layer {name: Leaf}]}.

    Args:
      fuse: q|k|v and gate|up as one matrix each (SamplerConfig.fuse_projections).
      pack: matrices in CPU-kernel panels (SamplerConfig.linear="cpu_kernel").
      lora: a model.lora.LoraConfig whose adapters the layers carry unmerged, or None.
    """
    specs = param_specs(cfg)
    top = {
        name: Leaf(s, lambda p, n=name: p[n])
        for name, s in specs.items()
        if name not in ("layers", "lm_head")
    }
    if not cfg.tie_embeddings:
        head = ParamSpec((cfg.vocab_size, cfg.d_model), cfg.param_dtype, ("vocab", "embed"))
        top["lm_head"] = Leaf(head, lambda p: p["lm_head"].T, matrix=True)
    layer = _layer_leaves(cfg, fuse)
    if pack:
        maybe = lambda leaf: (
            leaf.packed() if leaf.matrix and leaf.spec.shape[0] % cpu_kernels.PANEL == 0 else leaf
        )
        top = {name: maybe(leaf) for name, leaf in top.items()}
        layer = {name: maybe(leaf) for name, leaf in layer.items()}
    if lora is not None:
        layer = {**layer, **_adapter_leaves(cfg, lora)}
    return {**top, "layers": [layer] * cfg.n_layers}


def specs_of(tree) -> dict:
    """The ParamSpec tree of a `decode_layout` tree."""
    return jax.tree.map(lambda leaf: leaf.spec, tree, is_leaf=lambda x: isinstance(x, Leaf))


def _build(name: str, leaf: Leaf, src: dict):
    x = leaf.build(src)
    if tuple(x.shape) != leaf.spec.shape or x.dtype != jnp.dtype(leaf.spec.dtype):
        raise ValueError(
            f"decode layout leaf {name}: built {tuple(x.shape)} {x.dtype}, declared {leaf.spec.shape} "
            f"{leaf.spec.dtype}"
        )
    return x


def to_decode_layout(cfg: ModelConfig, params: dict, fuse: bool, pack: bool = False, lora=None) -> dict:
    """The model's parameters in the decode layout; pure, so it can be jitted with out shardings.

    Raises:
      ValueError: a built leaf differs from its declaration (shape or dtype; e.g. params of another dtype).
    """
    lay = decode_layout(cfg, fuse, pack, lora)
    out = {name: _build(name, leaf, params) for name, leaf in lay.items() if name != "layers"}
    out["layers"] = []
    for i, leaves in enumerate(lay["layers"]):
        lp = {name: x[i] for name, x in params["layers"].items()}
        out["layers"].append({name: _build(f"layers[{i}].{name}", leaf, lp) for name, leaf in leaves.items()})
    return out


def adapters_to_decode_layout(cfg: ModelConfig, adapters: dict, lora) -> list[dict]:
    """Only the adapter leaves of the decode layout, per layer, from a version's adapters with B already
    scaled (`model.lora.combine`): what an unmerged engine replaces per version."""
    leaves = _adapter_leaves(cfg, lora)
    src = adapters["layers"]
    out = []
    for i in range(cfg.n_layers):
        lp = {n: x[i] for n, x in src.items()}
        out.append({n: _build(f"layers[{i}].{n}", leaf, lp) for n, leaf in leaves.items()})
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The decode state, a pytree (of arrays, or of ParamSpecs in `decode_state`'s declaration).

    Attributes:
      k, v: per layer the keys and values; slotted [B, G, S, K]: slot b holds positions 0..pos[b]-1 at
        cache index == position. Paged [G, pages, page_size, K]: addressed through the host's page tables
        (`page_table.PageTable`).
      next_token: int32 [B], the token at position pos[b], the next step's input.
      pos: int32 [B].
      last_pos: int32 [B], position of the last token the slot may generate.
      done: bool [B], the slot is free or finished (frozen); all start free.
      key: uint32 [B, 2], the row key (seed, sample index).
    """

    k: list
    v: list
    next_token: object
    pos: object
    last_pos: object
    done: object
    key: object

    def replace(self, **fields) -> DecodeState:
        return dataclasses.replace(self, **fields)


def decode_state(
    model_cfg: ModelConfig, num_slots: int, cache_shape: tuple, cache_axes: tuple
) -> DecodeState:
    """The decode state as a ParamSpec tree; `initialize` gives the empty state (every slot free).

    Args:
      cache_shape, cache_axes: one layer's K (or V) buffer: slotted (num_slots, G, slot_len, K) with
        CACHE_AXES, or a page pool (`paged.PagedLayout.pool_shape`) with POOL_AXES.
    """
    cache = ParamSpec(tuple(cache_shape), model_cfg.dtype, cache_axes, "zeros")
    row = lambda dtype, init="zeros": ParamSpec((num_slots,), dtype, ("batch",), init)
    return DecodeState(
        k=[cache] * model_cfg.n_layers,
        v=[cache] * model_cfg.n_layers,
        next_token=row("int32"),
        pos=row("int32"),
        last_pos=row("int32"),
        done=row("bool", "ones"),
        key=ParamSpec((num_slots, 2), "uint32", ("batch", None), "zeros"),
    )


def initialize(specs):
    """Zeros / ones arrays of a ParamSpec tree (for `jax.jit` with out shardings)."""
    return jax.tree.map(lambda s: s.initialize(None), specs, is_leaf=lambda x: isinstance(x, ParamSpec))


def abstract(specs, shardings):
    """ShapeDtypeStructs with shardings of a ParamSpec tree (compile-only engines, executables)."""
    return jax.tree.map(
        lambda s, sh: s.abstract(sh), specs, shardings, is_leaf=lambda x: isinstance(x, ParamSpec)
    )


class InsertRow(NamedTuple):
    """What `insert` writes into a slot; it travels to the device as one int32 vector (one transfer)."""

    slot: int
    last_token: int  # the prompt's last token: the slot's next input
    pos: int  # its position, prompt_len - 1
    last_pos: int  # position of the last token the slot may generate
    seed: int  # the request's seed, its uint32 bits as an int32
    sample_index: int
    src: int  # the prefix's row in its prefilled batch

    def to_array(self) -> np.ndarray:
        return np.asarray(self, np.int32)

    @classmethod
    def from_array(cls, row) -> InsertRow:
        """The fields of an int32 vector (traced inside `insert`)."""
        return cls(*(row[i] for i in range(len(cls._fields))))
