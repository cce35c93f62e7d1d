"""The decoder-only transformer: one `layer`, run by `forward` (training, scoring) and the sampler's decode.

Einsum letters: B batch, T query positions, S key positions, D d_model, H query heads, G KV heads,
R = H / G query heads per KV head, K head dim, F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl_async.model import attention
from jaxrl_async.model.config import ModelConfig


def rms_norm(x, weight, eps: float, axes: int | tuple[int, ...] = -1):
    """RMSNorm over `axes` in float32, cast back to the input dtype before scaling (as HF does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axes, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """Inverse RoPE frequencies [K/2], with linear or Llama-3 scaling applied."""
    k = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, k, 2, dtype=jnp.float32) / k))
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s.kind == "linear":
        return inv / s.factor
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def apply_rope(x_BxTxNxK, positions_BxT, inv_freq):
    """Rotates the two halves of each head (HF's rotate_half convention)."""
    angles_BxTxK2 = positions_BxT[..., None].astype(jnp.float32) * inv_freq
    cos = jnp.cos(angles_BxTxK2)[:, :, None, :]
    sin = jnp.sin(angles_BxTxK2)[:, :, None, :]
    x = x_BxTxNxK.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxK.dtype)


@dataclasses.dataclass(frozen=True)
class Projections:
    """The matmuls of a transformer layer for one weight layout; the rest of the layer is layout-free.

    The model's own layout (`param_specs`, layers stacked) uses `EINSUM`; the sampler decodes with its
    decode layout's (`jaxrl_async.sampler.decode.PROJECTIONS`: 2-D output-major, optionally fused or packed
    weights). Each function returns activations in its input's dtype, without biases.

    Attributes:
      qkv: (cfg, lp, h_BxTxD) -> (q_BxTxHxK, k_BxTxGxK, v_BxTxGxK).
      out: (lp, attn_BxTxHxK) -> [B, T, D], the attention output projection.
      gate_up: (lp, h_BxTxD) -> (gate_BxTxF, up_BxTxF).
      down: (lp, act_BxTxF) -> [B, T, D].
    """

    qkv: Callable
    out: Callable
    gate_up: Callable
    down: Callable


def project(x, w, contract: int = 1):
    """x [..., *C] times w [*C, *O] -> [..., *O], as one 2-D matmul over the rows of x (C: the last
    `contract` dims of x, the first of w).

    Why not an einsum over [B, T, D]: its weight gradient contracts over two row dims (b, t), and XLA:CPU
    then writes the activation gradient out transposed, element by element, before the matmul. Measured
    on the tiny 3-layer model's train micro-batch (64 x 72 rows, idle 2-core Intel Xeon): the transposes
    took about 40% of the step. Flattening the rows first is free on every backend (a bitcast) and keeps
    the batch sharding, which lives on the leading, major dim.
    """
    c = math.prod(x.shape[x.ndim - contract :])
    y = jnp.dot(x.reshape(-1, c), w.astype(x.dtype).reshape(c, -1))
    return y.reshape(*x.shape[: x.ndim - contract], *w.shape[contract:])


def project_adapted(x, lp: dict, name: str, contract: int = 1):
    """x times the layer's weight `name`, plus (x·A)·B when the layer carries LoRA adapters for it
    (`name`_lora_a / `name`_lora_b, B already scaled: `model.lora.combine`). Unmerged, so a frozen base
    costs no weight gradient: only the two thin products are differentiated."""
    y = project(x, lp[name], contract)
    a = lp.get(f"{name}_lora_a")
    if a is None:
        return y
    return y + project(project(x, a, contract), lp[f"{name}_lora_b"])


def _einsum_qkv(cfg: ModelConfig, lp: dict, h_BxTxD):
    return tuple(project_adapted(h_BxTxD, lp, n) for n in ("q", "k", "v"))


EINSUM = Projections(
    qkv=_einsum_qkv,
    out=lambda lp, a_BxTxHxK: project_adapted(a_BxTxHxK, lp, "o", contract=2),
    gate_up=lambda lp, h_BxTxD: (project_adapted(h_BxTxD, lp, "gate"), project_adapted(h_BxTxD, lp, "up")),
    down=lambda lp, a_BxTxF: project_adapted(a_BxTxF, lp, "down"),
)


def embed(cfg: ModelConfig, params: dict, tokens):
    """Embeddings of int32 tokens (any shape) in the compute dtype."""
    return params["embed"].astype(jnp.dtype(cfg.dtype))[tokens]


def qk_norm(cfg: ModelConfig, lp: dict, q_BxTxHxK, k_BxTxGxK):
    """RMSNorm of queries and keys before RoPE (`cfg.qk_norm`): per head (Qwen3), or with
    `cfg.qk_norm_all_heads` over all heads of the position at once (OLMo 2)."""
    if not cfg.qk_norm:
        return q_BxTxHxK, k_BxTxGxK
    axes = (-2, -1) if cfg.qk_norm_all_heads else -1
    norm = lambda x, w: rms_norm(x, w, cfg.rms_eps, axes)
    return norm(q_BxTxHxK, lp["q_norm"]), norm(k_BxTxGxK, lp["k_norm"])


def attention_inputs(cfg: ModelConfig, proj: Projections, lp: dict, x_BxTxD, positions_BxT, inv_freq):
    """A layer's first half: pre-norm, q/k/v projections with their biases, QK-norm and RoPE.

    Returns:
      (q_BxTxHxK, k_BxTxGxK, v_BxTxGxK) in x's dtype.
    """
    dt = x_BxTxD.dtype
    h_BxTxD = rms_norm(x_BxTxD, lp["attn_norm"], cfg.rms_eps)
    q, k, v = proj.qkv(cfg, lp, h_BxTxD)
    if cfg.qkv_bias:
        q, k, v = q + lp["q_bias"].astype(dt), k + lp["k_bias"].astype(dt), v + lp["v_bias"].astype(dt)
    q, k = qk_norm(cfg, lp, q, k)
    return apply_rope(q, positions_BxT, inv_freq), apply_rope(k, positions_BxT, inv_freq), v


def layer_output(cfg: ModelConfig, proj: Projections, lp: dict, x_BxTxD, attn_BxTxHxK):
    """A layer's second half: output projection, residual, the MLP block and its residual."""
    dt = x_BxTxD.dtype
    out_BxTxD = proj.out(lp, attn_BxTxHxK.astype(dt))
    if cfg.o_bias:
        out_BxTxD = out_BxTxD + lp["o_bias"].astype(dt)
    x_BxTxD = x_BxTxD + out_BxTxD
    h_BxTxD = rms_norm(x_BxTxD, lp["mlp_norm"], cfg.rms_eps)
    gate, up = proj.gate_up(lp, h_BxTxD)
    return x_BxTxD + proj.down(lp, jax.nn.silu(gate) * up)


def layer(cfg: ModelConfig, proj: Projections, lp: dict, x_BxTxD, positions_BxT, inv_freq, attend):
    """One transformer block, the only definition of it: the trainer, prefill and every decode back-end
    run this with their own weight layout (`proj`) and attention (`attend`).

    Args:
      attend: (q_BxTxHxK, k_BxTxGxK, v_BxTxGxK) -> (attention [B, T, H, K], aux): the attention over the
        layer's keys and values with the row's mask; `aux` is returned as is (a decode step's updated cache).

    Returns:
      (x_BxTxD, aux).
    """
    q, k, v = attention_inputs(cfg, proj, lp, x_BxTxD, positions_BxT, inv_freq)
    attn_BxTxHxK, aux = attend(q, k, v)
    return layer_output(cfg, proj, lp, x_BxTxD, attn_BxTxHxK), aux


def final_norm(cfg: ModelConfig, params: dict, x_BxTxD):
    """The norm after the last layer."""
    return rms_norm(x_BxTxD, params["final_norm"], cfg.rms_eps)


def forward(
    cfg: ModelConfig,
    params: dict,
    tokens_BxT,
    positions_BxT,
    segment_ids=None,
    remat: bool = False,
    return_hidden: bool = False,
    mesh=None,
    unroll: bool = False,
):
    """Runs the model over whole (packed) rows: training, scoring and `forward_logits` (the sampler decodes
    with the same `layer` over its own layout, `jaxrl_async.sampler.decode`).

    Args:
      cfg: model config (static).
      params: parameter tree from `param_specs`.
      tokens_BxT: int32 tokens.
      positions_BxT: int32 absolute positions (per segment when packed).
      segment_ids: int32 [B, T] with 0 = padding; a token attends to earlier tokens (in index order) of its
        own segment. None = one segment per row.
      remat: rematerialize each layer in the backward pass.
      return_hidden: return the final normed hidden states [B, T, D] instead of logits.
      mesh: the mesh the call is sharded on (a kernel such as splash attention runs per device on it).
      unroll: unroll the layers instead of scanning them (TrainConfig.unroll_layers says when it pays).

    Returns:
      logits [B, T, V] float32 (or the hidden states [B, T, D] with `return_hidden`).
    """
    b, t = tokens_BxT.shape
    x_BxTxD = embed(cfg, params, tokens_BxT)
    inv_freq = rope_inv_freq(cfg)
    if attention.resolve(cfg.attention, cfg.platform) == "reference":
        # Padding rows attend to themselves so softmax stays finite; their outputs are masked downstream.
        mask_BxTxS = attention.packed_causal_mask(segment_ids, t, b)
        attend = lambda q, k, v: (attention.reference_attention(q, k, v, mask_BxTxS), None)
    else:
        attend = lambda q, k, v: (
            attention.attend(cfg.attention, q, k, v, segment_ids, mesh, cfg.platform),
            None,
        )

    def body(x, lp):
        return layer(cfg, EINSUM, lp, x, positions_BxT, inv_freq, attend)

    if remat:
        body = jax.checkpoint(body, prevent_cse=False)
    x_BxTxD, _ = jax.lax.scan(body, x_BxTxD, params["layers"], unroll=unroll)
    x_BxTxD = final_norm(cfg, params, x_BxTxD)
    if return_hidden:
        return x_BxTxD
    return unembed(cfg, params, x_BxTxD)


def unembed(cfg: ModelConfig, params: dict, x_BxTxD):
    """Float32 logits [B, T, V] from final hidden states."""
    dt = x_BxTxD.dtype
    if cfg.tie_embeddings:
        return jnp.einsum(
            "btd,vd->btv", x_BxTxD, params["embed"].astype(dt), preferred_element_type=jnp.float32
        )
    return jnp.einsum(
        "btd,dv->btv", x_BxTxD, params["lm_head"].astype(dt), preferred_element_type=jnp.float32
    )


def forward_logits(cfg: ModelConfig, params: dict, tokens_BxT) -> jax.Array:
    """Float32 logits [B, T, V] for int32 tokens [B, T] at positions 0..T-1 (no cache, no packing)."""
    tokens_BxT = jnp.asarray(tokens_BxT, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1], dtype=jnp.int32), tokens_BxT.shape)
    return _forward_logits_jit(cfg, params, tokens_BxT, positions)


@functools.partial(jax.jit, static_argnums=0)
def _forward_logits_jit(cfg, params, tokens_BxT, positions_BxT):
    return forward(cfg, params, tokens_BxT, positions_BxT)


def token_logprobs(logits_BxTxV, targets_BxT, temperature: float = 1.0):
    """Log-probabilities of `targets` under softmax(logits / temperature), and the entropy, float32 [B, T].

    The sampler and the trainer both call this, so behaviour and trainer logprobs agree exactly.
    """
    logits = logits_BxTxV.astype(jnp.float32) / temperature
    logz = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets_BxT[..., None].astype(jnp.int32), axis=-1)[..., 0]
    logp_all = logits - logz[..., None]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return tgt - logz, entropy


def chunked_token_logprobs(
    cfg: ModelConfig, params: dict, x_BxTxD, targets_BxT, temperature: float = 1.0, chunk: int = 0
):
    """`token_logprobs(unembed(x), targets)` computed `chunk` positions at a time.

    Only one chunk's float32 logits [B, chunk, V] exist at once, in the forward and (recomputed) in the
    backward pass: a 32k-position row of a 152k vocabulary would otherwise hold 20 GB of logits, plus
    their gradient. Same numbers as the one-piece computation. `chunk` = 0 or >= T: one piece.

    Raises:
      ValueError: T is longer than `chunk` and not a multiple of it.
    """
    b, t, d = x_BxTxD.shape
    if chunk <= 0 or chunk >= t:
        return token_logprobs(unembed(cfg, params, x_BxTxD), targets_BxT, temperature)
    if t % chunk:
        raise ValueError(f"logprob chunk {chunk} does not divide the row length {t}")
    n = t // chunk

    @jax.checkpoint
    def piece(args):
        x_BxCxD, tgt_BxC = args
        return token_logprobs(unembed(cfg, params, x_BxCxD), tgt_BxC, temperature)

    xs = x_BxTxD.reshape(b, n, chunk, d).swapaxes(0, 1)
    tgts = targets_BxT.reshape(b, n, chunk).swapaxes(0, 1)
    logp_NxBxC, ent_NxBxC = jax.lax.map(piece, (xs, tgts))
    return logp_NxBxC.swapaxes(0, 1).reshape(b, t), ent_NxBxC.swapaxes(0, 1).reshape(b, t)
