"""Prefill and decode steps: the model's own `layer` over the decode layout (`layout.py`), with the
sampler's attention back-ends.

The layer itself (norms, biases, QK-norm, RoPE, residuals, MLP) is `jaxrl_async.model.transformer.layer`,
shared with the trainer. What is decode-specific lives here:
  - `PROJECTIONS`: the layer's matmuls over 2-D output-major weights ([N_out, D_in]; fused q|k|v and gate|up
    when the layout has them; CPU-kernel panels when packed);
  - the layer loop, unrolled over the per-layer weights and cache buffers;
  - attention: prefill follows `ModelConfig.attention` like the trainer (the reference implementation is
    `_attend` over head-major keys); a decode step writes each row's new key/value into its cache and
    attends with SamplerConfig.attention: "xla" (`_attend` over the whole slotted row), "cpu_kernel"
    (`cpu_kernels.decode_attention`, valid positions only) or "paged_kernel" (`paged`, the Pallas kernel
    over the row's pages).

Einsum letters as in the model: B batch, T query positions, S cache positions, D d_model, H query heads,
G KV heads, R = H / G, K head dim, F MLP width, V vocabulary, M = B * T rows of a matmul.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_async.model import ModelConfig, attention
from jaxrl_async.model.transformer import (
    Projections,
    attention_inputs,
    embed,
    final_norm,
    layer,
    layer_output,
    rope_inv_freq,
)
from jaxrl_async.sampler import cpu_kernels, paged

_NEG_INF = -1e30


def _linear(x_MxD, w_NxD):
    """x @ w.T for an output-major weight, in x's dtype (a packed [N/16, D, 16] weight: the CPU kernel)."""
    if w_NxD.ndim == 3:
        return cpu_kernels.linear(x_MxD, w_NxD).astype(x_MxD.dtype)
    return jax.lax.dot_general(x_MxD, w_NxD.astype(x_MxD.dtype), (((1,), (1,)), ((), ())))


def _rows(fn, x_BxTxN, w):
    """`fn` over the rows of x flattened to [B * T, N], reshaped back to [B, T, -1]."""
    b, t, n = x_BxTxN.shape
    return fn(x_BxTxN.reshape(b * t, n), w).reshape(b, t, -1)


def _adapted(lp: dict, name: str, x_BxTxN, y_BxTxM):
    """y plus the unmerged LoRA term (x·A)·B of weight `name` when the layer carries one
    (SamplerConfig.lora_apply="unmerged"; `layout._adapter_leaves`)."""
    a = lp.get(f"{name}_lora_a")
    if a is None:
        return y_BxTxM
    delta = _rows(_linear, _rows(_linear, x_BxTxN, a), lp[f"{name}_lora_b"])
    return y_BxTxM + delta.reshape(y_BxTxM.shape)


def _qkv(cfg: ModelConfig, lp: dict, h_BxTxD):
    b, t, _ = h_BxTxD.shape
    G, K = cfg.n_kv_heads, cfg.head_dim
    R = cfg.n_heads // G
    if "qkv" in lp:
        qkv_BxTxGxJxK = _rows(_linear, h_BxTxD, lp["qkv"]).reshape(b, t, G, R + 2, K)  # J: R q heads, k, v
        q = qkv_BxTxGxJxK[:, :, :, :R].reshape(b, t, G * R, K)
        q, k, v = q, qkv_BxTxGxJxK[:, :, :, R], qkv_BxTxGxJxK[:, :, :, R + 1]
    else:
        q = _rows(_linear, h_BxTxD, lp["q"]).reshape(b, t, G * R, K)
        k = _rows(_linear, h_BxTxD, lp["k"]).reshape(b, t, G, K)
        v = _rows(_linear, h_BxTxD, lp["v"]).reshape(b, t, G, K)
    return tuple(_adapted(lp, n, h_BxTxD, y) for n, y in (("q", q), ("k", k), ("v", v)))


def _out(lp: dict, attn_BxTxHxK):
    b, t = attn_BxTxHxK.shape[:2]
    x_BxTxN = attn_BxTxHxK.reshape(b, t, -1)
    return _adapted(lp, "o", x_BxTxN, _rows(_linear, x_BxTxN, lp["o"]))


def _gate_up(lp: dict, h_BxTxD):
    if "gate_up" in lp:
        gu_BxTxFx2 = _rows(_linear, h_BxTxD, lp["gate_up"]).reshape(*h_BxTxD.shape[:2], -1, 2)
        gate, up = gu_BxTxFx2[..., 0], gu_BxTxFx2[..., 1]
    else:
        gate, up = _rows(_linear, h_BxTxD, lp["gate"]), _rows(_linear, h_BxTxD, lp["up"])
    return _adapted(lp, "gate", h_BxTxD, gate), _adapted(lp, "up", h_BxTxD, up)


def _down(lp: dict, a_BxTxF):
    return _adapted(lp, "down", a_BxTxF, _rows(_linear, a_BxTxF, lp["down"]))


# The layer's matmuls over the decode layout (see the module doc).
PROJECTIONS = Projections(qkv=_qkv, out=_out, gate_up=_gate_up, down=_down)


def _unembed(cfg: ModelConfig, dparams: dict, x_BxD):
    """Float32 logits [B, V] (the lm head, or the tied embedding)."""
    unembed_VxD = dparams["lm_head"] if "lm_head" in dparams else dparams["embed"]
    if unembed_VxD.ndim == 3:  # packed lm head
        return cpu_kernels.linear(x_BxD, unembed_VxD)
    return jax.lax.dot_general(
        x_BxD, unembed_VxD.astype(x_BxD.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )


def _attend(q_BxTxHxK, k_BxGxSxK, v_BxGxSxK, mask_BxTxS):
    """Grouped-query attention over a head-major key/value buffer; float32 scores as in the model."""
    b, t, h, kd = q_BxTxHxK.shape
    g = k_BxGxSxK.shape[1]
    q_BxGxRxTxK = q_BxTxHxK.reshape(b, t, g, h // g, kd).transpose(0, 2, 3, 1, 4)
    scores = jnp.einsum("bgrtk,bgsk->bgrts", q_BxGxRxTxK, k_BxGxSxK, preferred_element_type=jnp.float32)
    scores = jnp.where(mask_BxTxS[:, None, None], scores * (kd**-0.5), _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxGxSxK.dtype)
    out_BxGxRxTxK = jnp.einsum("bgrts,bgsk->bgrtk", probs, v_BxGxSxK)
    return out_BxGxRxTxK.transpose(0, 3, 1, 2, 4).reshape(b, t, h, kd)


def prefill_kv(cfg: ModelConfig, dparams: dict, tokens_BxT, mesh=None):
    """Keys and values of tokens at positions 0..T-1 (causal; right padding is harmless).

    Attention follows `cfg.attention` like the trainer's (`jaxrl_async.model.attention`; the reference
    implementation is `_attend`, shared with decoding); `mesh` is the sampler mesh the call runs on.

    Returns:
      (keys, values): per layer [B, G, T, K] in the compute dtype.
    """
    b, t = tokens_BxT.shape
    positions_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    inv_freq = rope_inv_freq(cfg)
    mask_BxTxS = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    reference = attention.resolve(cfg.attention, cfg.platform) == "reference"
    x_BxTxD = embed(cfg, dparams, tokens_BxT)
    keys, values = [], []
    for i, lp in enumerate(dparams["layers"]):
        q, k, v = attention_inputs(cfg, PROJECTIONS, lp, x_BxTxD, positions_BxT, inv_freq)
        k_BxGxTxK, v_BxGxTxK = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        keys.append(k_BxGxTxK)
        values.append(v_BxGxTxK)
        if i + 1 < len(dparams["layers"]):  # the last layer's output is never needed
            if reference:
                attn_BxTxHxK = _attend(q, k_BxGxTxK, v_BxGxTxK, mask_BxTxS)
            else:
                attn_BxTxHxK = attention.attend(cfg.attention, q, k, v, mesh=mesh, platform=cfg.platform)
            x_BxTxD = layer_output(cfg, PROJECTIONS, lp, x_BxTxD, attn_BxTxHxK)
    return keys, values


def extend_kv(cfg: ModelConfig, dparams: dict, views: list, tokens_1xT, positions_1xT):
    """Keys and values of T tokens appended to one sequence (a multi-turn episode's observation).

    Args:
      views: per layer (K, V) [1, G, S, K]: the sequence's cache as one contiguous row (cache index ==
        position), valid below positions_1xT[0, 0].
      tokens_1xT, positions_1xT: the tokens and their absolute positions (consecutive).

    Returns:
      (keys, values): per layer [T, G, K]; each token attends to the valid cache and to the tokens before
      it, exactly as a prefill of the whole sequence would (the reference `_attend`, float32 scores).
    """
    inv_freq = rope_inv_freq(cfg)
    mask_1xTxS = jnp.arange(views[0][0].shape[2])[None, None, :] <= positions_1xT[:, :, None]
    x_1xTxD = embed(cfg, dparams, tokens_1xT)
    keys, values = [], []
    for i, lp in enumerate(dparams["layers"]):
        q, k, v = attention_inputs(cfg, PROJECTIONS, lp, x_1xTxD, positions_1xT, inv_freq)
        keys.append(k[0])
        values.append(v[0])
        if i + 1 < len(dparams["layers"]):  # the last layer's output is never needed
            kc, vc = (
                view.at[0, :, positions_1xT[0]].set(new[0].astype(view.dtype), mode="drop")
                for view, new in zip(views[i], (k, v), strict=True)
            )
            attn_1xTxHxK = _attend(q, kc.astype(q.dtype), vc.astype(q.dtype), mask_1xTxS)
            x_1xTxD = layer_output(cfg, PROJECTIONS, lp, x_1xTxD, attn_1xTxHxK)
    return keys, values


def _slotted_attend(attention_impl: str, k_BxGxSxK, v_BxGxSxK, positions_B, mask_Bx1xS):
    """A decode step's attention over one layer's slotted cache: writes each row's new key/value at its
    position, then attends to the positions <= it (`layer`'s `attend`; aux = the updated buffers)."""

    def attend(q_Bx1xHxK, k_Bx1xGxK, v_Bx1xGxK):
        b, _, h, kd = q_Bx1xHxK.shape
        rows = jnp.arange(b)
        kc = k_BxGxSxK.at[rows, :, positions_B].set(k_Bx1xGxK[:, 0].astype(k_BxGxSxK.dtype))
        vc = v_BxGxSxK.at[rows, :, positions_B].set(v_Bx1xGxK[:, 0].astype(v_BxGxSxK.dtype))
        if attention_impl == "cpu_kernel":
            q_BxGxRxK = q_Bx1xHxK[:, 0].reshape(b, kc.shape[1], -1, kd)
            out = cpu_kernels.decode_attention(q_BxGxRxK, kc, vc, positions_B + 1).reshape(b, 1, h, kd)
        else:
            dt = q_Bx1xHxK.dtype
            out = _attend(q_Bx1xHxK, kc.astype(dt), vc.astype(dt), mask_Bx1xS)
        return out, (kc, vc)

    return attend


def _paged_attend(layout: paged.PagedLayout, kpool, vpool, table_BxW, positions_B, done_B):
    """As `_slotted_attend` for one layer's page pools (rows that are done write to the scratch page)."""

    def attend(q_Bx1xHxK, k_Bx1xGxK, v_Bx1xGxK):
        out_BxHxK, kp, vp = paged.write_and_attend(
            layout,
            q_Bx1xHxK[:, 0],
            k_Bx1xGxK[:, 0],
            v_Bx1xGxK[:, 0],
            kpool,
            vpool,
            table_BxW,
            positions_B,
            done_B,
        )
        return out_BxHxK[:, None], (kp, vp)

    return attend


def slotted_attention(attention_impl: str, positions_B, cache_len: int):
    """A decode step's attention over slotted caches of `cache_len` positions: (a layer's K, V buffers) ->
    that layer's `attend` (the mask is built once per step)."""
    mask_Bx1xS = (jnp.arange(cache_len)[None, :] <= positions_B[:, None])[:, None, :]
    return lambda k, v: _slotted_attend(attention_impl, k, v, positions_B, mask_Bx1xS)


def paged_attention(layout: paged.PagedLayout, table_BxW, positions_B, done_B):
    """As `slotted_attention` for page pools read through every row's page table."""
    return lambda kpool, vpool: _paged_attend(layout, kpool, vpool, table_BxW, positions_B, done_B)


def decode_step(
    cfg: ModelConfig,
    dparams: dict,
    keys: list,
    values: list,
    tokens_B,
    positions_B,
    attention: str = "xla",
    layer_attention=None,
):
    """One decode step: writes each row's new key/value at its own position, attends to positions <= it.

    Args:
      keys, values: per layer [B, G, S, K] caches, or [G, pages, page_size, K] page pools (updated in place
        when donated).
      tokens_B: int32 input token per row; positions_B: its absolute position (= cache index).
      attention: for slotted caches without `layer_attention`: "xla" (einsums over the whole row) or
        "cpu_kernel" (`cpu_kernels`: valid positions only).
      layer_attention: (a layer's K, V buffers) -> its `attend` (`slotted_attention`, `paged_attention`;
        the engine takes it from its cache object, `cache.py`).

    Returns:
      (logits_BxV float32, keys, values).
    """
    if layer_attention is None:
        layer_attention = slotted_attention(attention, positions_B, keys[0].shape[2])
    inv_freq = rope_inv_freq(cfg)
    positions_Bx1 = positions_B[:, None]
    x_Bx1xD = embed(cfg, dparams, tokens_B[:, None])
    keys, values = list(keys), list(values)
    for i, lp in enumerate(dparams["layers"]):
        attend = layer_attention(keys[i], values[i])
        x_Bx1xD, (keys[i], values[i]) = layer(cfg, PROJECTIONS, lp, x_Bx1xD, positions_Bx1, inv_freq, attend)
    logits_BxV = _unembed(cfg, dparams, final_norm(cfg, dparams, x_Bx1xD)[:, 0])
    return logits_BxV, keys, values
