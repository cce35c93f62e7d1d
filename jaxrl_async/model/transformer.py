"""The decoder-only transformer: one `forward` for training (packed, no cache) and decoding (KV cache).

Einsum letters: B batch, T query positions, S key positions, D d_model, H query heads, G KV heads,
R = H / G query heads per KV head, K head dim, F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxrl_async.model import attention
from jaxrl_async.model.config import ModelConfig


def rms_norm(x, weight, eps: float):
    """RMSNorm in float32, cast back to the input dtype before scaling (as HF does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
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


def _write_cache(cache_BxSxGxK, new_BxTxGxK, start_B):
    """Writes each row's T new entries at its own start index (ragged per-slot lengths)."""
    write = lambda c, u, s: jax.lax.dynamic_update_slice(c, u, (s, 0, 0))
    return jax.vmap(write)(cache_BxSxGxK, new_BxTxGxK.astype(cache_BxSxGxK.dtype), start_B)


def _layer(cfg: ModelConfig, lp: dict, x_BxTxD, positions_BxT, inv_freq, attend, kv=None):
    """One transformer block; `kv` is this layer's (k_BxSxGxK, v_BxSxGxK) cache or None.

    `attend(q, k, v)` is the attention over the layer's keys and values (with the row's mask).
    """
    dt = x_BxTxD.dtype
    h_BxTxD = rms_norm(x_BxTxD, lp["attn_norm"], cfg.rms_eps)
    q = jnp.einsum("btd,dhk->bthk", h_BxTxD, lp["q"].astype(dt))
    k = jnp.einsum("btd,dgk->btgk", h_BxTxD, lp["k"].astype(dt))
    v = jnp.einsum("btd,dgk->btgk", h_BxTxD, lp["v"].astype(dt))
    if cfg.qkv_bias:
        q, k, v = q + lp["q_bias"].astype(dt), k + lp["k_bias"].astype(dt), v + lp["v_bias"].astype(dt)
    if cfg.qk_norm:
        q, k = rms_norm(q, lp["q_norm"], cfg.rms_eps), rms_norm(k, lp["k_norm"], cfg.rms_eps)
    q, k = apply_rope(q, positions_BxT, inv_freq), apply_rope(k, positions_BxT, inv_freq)
    if kv is not None:
        k_cache, v_cache = kv
        k_cache = _write_cache(k_cache, k, positions_BxT[:, 0])
        v_cache = _write_cache(v_cache, v, positions_BxT[:, 0])
        kv = (k_cache, v_cache)
        k, v = k_cache.astype(dt), v_cache.astype(dt)
    attn_BxTxHxK = attend(q, k, v)
    out = jnp.einsum("bthk,hkd->btd", attn_BxTxHxK, lp["o"].astype(dt))
    if cfg.o_bias:
        out = out + lp["o_bias"].astype(dt)
    x_BxTxD = x_BxTxD + out
    h_BxTxD = rms_norm(x_BxTxD, lp["mlp_norm"], cfg.rms_eps)
    gate = jnp.einsum("btd,df->btf", h_BxTxD, lp["gate"].astype(dt))
    up = jnp.einsum("btd,df->btf", h_BxTxD, lp["up"].astype(dt))
    x_BxTxD = x_BxTxD + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, lp["down"].astype(dt))
    return x_BxTxD, kv


def forward(
    cfg: ModelConfig,
    params: dict,
    tokens_BxT,
    positions_BxT,
    segment_ids=None,
    cache=None,
    remat: bool = False,
    return_hidden: bool = False,
    mesh=None,
):
    """Runs the model.

    Args:
      cfg: model config (static).
      params: parameter tree from `param_specs`.
      tokens_BxT: int32 tokens.
      positions_BxT: int32 absolute positions (per segment when packed; cache index when decoding).
      segment_ids: int32 [B, T] with 0 = padding; without a cache, a token attends to earlier tokens (in
        index order) of its own segment. None = one segment per row.
      cache: None (training) or {"k", "v": [L, B, S, G, K]}; row b's T new entries are written at cache
        index positions[b, 0] ... and each query attends to cache indices <= its position.
      remat: rematerialize each layer in the backward pass.
      return_hidden: return the final normed hidden states [B, T, D] instead of logits.
      mesh: the mesh the call is sharded on (a kernel such as splash attention runs per device on it).

    Returns:
      (logits [B, T, V] float32 (or hidden), the updated cache or None).
    """
    dt = jnp.dtype(cfg.dtype)
    b, t = tokens_BxT.shape
    x_BxTxD = params["embed"].astype(dt)[tokens_BxT]
    inv_freq = rope_inv_freq(cfg)
    if cache is not None:  # decoding attends to cache indices <= each query's position
        s = cache["k"].shape[2]
        mask_BxTxS = jnp.arange(s)[None, None, :] <= positions_BxT[:, :, None]
        attend = lambda q, k, v: attention.reference_attention(q, k, v, mask_BxTxS)
    elif attention.resolve(cfg.attention) == "reference":
        # Padding rows attend to themselves so softmax stays finite; their outputs are masked downstream.
        mask_BxTxS = attention.packed_causal_mask(segment_ids, t, b)
        attend = lambda q, k, v: attention.reference_attention(q, k, v, mask_BxTxS)
    else:
        attend = lambda q, k, v: attention.attend(cfg.attention, q, k, v, segment_ids, mesh)

    def body(carry, lp):
        x, layer_idx, kc, vc = carry
        kv = None if cache is None else (kc[layer_idx], vc[layer_idx])
        x, kv = _layer(cfg, lp, x, positions_BxT, inv_freq, attend, kv)
        if cache is not None:
            kc, vc = kc.at[layer_idx].set(kv[0]), vc.at[layer_idx].set(kv[1])
        return (x, layer_idx + 1, kc, vc), None

    if remat:
        body = jax.checkpoint(body, prevent_cse=False)
    kc, vc = (None, None) if cache is None else (cache["k"], cache["v"])
    (x_BxTxD, _, kc, vc), _ = jax.lax.scan(body, (x_BxTxD, jnp.int32(0), kc, vc), params["layers"])
    x_BxTxD = rms_norm(x_BxTxD, params["final_norm"], cfg.rms_eps)
    new_cache = None if cache is None else {"k": kc, "v": vc}
    if return_hidden:
        return x_BxTxD, new_cache
    return unembed(cfg, params, x_BxTxD), new_cache


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
    return forward(cfg, params, tokens_BxT, positions_BxT)[0]


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


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: str | None = None, sharding=None) -> dict:
    """An empty KV cache {"k", "v": [L, B, S, G, K]}; `sharding` places it (e.g. on the sampler mesh)."""
    shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    dt = jnp.dtype(dtype or cfg.dtype)
    make = lambda: {"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)}
    if sharding is None:
        return make()
    return jax.jit(make, out_shardings={"k": sharding, "v": sharding})()


CACHE_LOGICAL_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")
