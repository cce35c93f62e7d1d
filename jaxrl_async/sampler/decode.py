"""Decode-specific forward passes over a per-layer, head-major KV cache.

The model's `forward` (shared with the trainer) scans over stacked layers and keeps the whole [L, B, S, G, K]
cache in the scan carry; on XLA:CPU that copies cache slices every step (measured ~5x slower per decode
step at batch 1 on llama_100m). The sampler therefore decodes with its own layout, computed once per weight
update by `to_decode_layout`:
  - layers unstacked into a list (the layer loop is unrolled, so every weight and cache buffer is static),
  - every matrix 2-D and output-major ([N_out, D_in]), optionally with q|k|v fused into one matrix and
    gate|up into another (fewer, larger matmuls),
  - the cache as one [B, G, S, K] buffer per layer (head-major: attention is a plain batched matmul).
The numerics follow `jaxrl_async.model.transformer` op for op (the tests check equality with `forward`).

Einsum letters as in the model: B batch, T query positions, S cache positions, D d_model, H query heads,
G KV heads, R = H / G, K head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_async.model import ModelConfig, abstract_params, attention, param_specs
from jaxrl_async.model.transformer import apply_rope, rms_norm, rope_inv_freq
from jaxrl_async.sampler import cpu_kernels, paged

_NEG_INF = -1e30
CACHE_AXES = ("batch", "kv_heads", "seq", "head_dim")  # logical axes of one layer's K or V buffer


def _packable(name: str, shape) -> bool:
    """Matrices the CPU linear kernel takes packed (not the embedding: decoding looks rows up in it)."""
    return name != "embed" and len(shape) == 2 and shape[0] % cpu_kernels.PANEL == 0


def to_decode_layout(cfg: ModelConfig, params: dict, fuse: bool, pack: bool = False) -> dict:
    """The sampler's parameter layout (see module doc); pure, so it can be jitted with out shardings.

    Every matrix is 2-D and output-major, [N_out, D_in]: XLA:CPU then contracts the weight's last axis
    in place. With multi-axis weights it inserted a transposing copy of the weight every step at batch 1,
    and with [in, out] weights its small-row matmuls were ~1.7x slower at batch 32 (measured).
    Fused q|k|v rows are ordered (kv head, q heads of the group + k + v, head dim) and gate|up rows
    (F, 2), so sharding the row axis over "tensor" splits whole KV groups / MLP columns.
    With `pack` (SamplerConfig.linear="cpu_kernel") every matrix whose row count is a multiple of 16 is
    stored in `cpu_kernels.pack` panels, [N/16, D, 16], and `_linear` sends it to the CPU kernel.
    """
    D, G, K = cfg.d_model, cfg.n_kv_heads, cfg.head_dim
    R = cfg.n_heads // G
    out = {k: v for k, v in params.items() if k not in ("layers", "lm_head")}
    if not cfg.tie_embeddings:
        out["lm_head"] = params["lm_head"].T  # [V, D]
    layers = []
    for i in range(cfg.n_layers):
        lp = {k: v[i] for k, v in params["layers"].items()}
        lp["o"] = lp["o"].reshape(-1, D).T  # [D, H*K]
        lp["down"] = lp["down"].T  # [D, F]
        if fuse:
            q = lp.pop("q").reshape(D, G, R, K)
            qkv = jnp.concatenate([q, lp.pop("k")[:, :, None], lp.pop("v")[:, :, None]], axis=2)
            lp["qkv"] = qkv.reshape(D, -1).T  # [G*(R+2)*K, D]
            if cfg.qkv_bias:
                qb, kb, vb = lp.pop("q_bias").reshape(G, R, K), lp.pop("k_bias"), lp.pop("v_bias")
                lp["qkv_bias"] = jnp.concatenate([qb, kb[:, None], vb[:, None]], 1).reshape(-1)
            lp["gate_up"] = jnp.stack([lp.pop("gate"), lp.pop("up")], axis=-1).reshape(D, -1).T  # [F*2, D]
        else:
            for name in ("q", "k", "v"):
                lp[name] = lp[name].reshape(D, -1).T  # [N*K, D]
                if cfg.qkv_bias:
                    lp[name + "_bias"] = lp[name + "_bias"].reshape(-1)
            lp["gate"], lp["up"] = lp["gate"].T, lp["up"].T  # [F, D]
        layers.append(lp)
    out["layers"] = layers
    if pack:
        packed = lambda name, w: cpu_kernels.pack(w) if _packable(name, w.shape) else w
        out = {k: packed(k, v) for k, v in out.items() if k != "layers"} | {
            "layers": [{k: packed(k, v) for k, v in lp.items()} for lp in layers]
        }
    return out


def decode_layout_axes(cfg: ModelConfig, fuse: bool, pack: bool = False) -> dict:
    """Logical axes of every leaf of `to_decode_layout`'s output (for shardings)."""
    specs = param_specs(cfg)
    out = {k: v.logical_axes for k, v in specs.items() if k not in ("layers", "lm_head")}
    if not cfg.tie_embeddings:
        out["lm_head"] = ("vocab", "embed")
    lp = {k: v.logical_axes[1:] for k, v in specs["layers"].items()}
    lp["o"], lp["down"] = ("embed", "q_heads"), ("embed", "mlp")
    if fuse:
        for name in ("q", "k", "v", "gate", "up"):
            lp.pop(name)
        lp["qkv"], lp["gate_up"] = ("kv_heads", "embed"), ("mlp", "embed")
        if cfg.qkv_bias:
            for name in ("q_bias", "k_bias", "v_bias"):
                lp.pop(name)
            lp["qkv_bias"] = ("kv_heads",)
    else:
        lp["q"], lp["k"], lp["v"] = ("q_heads", "embed"), ("kv_heads", "embed"), ("kv_heads", "embed")
        lp["gate"] = lp["up"] = ("mlp", "embed")
        if cfg.qkv_bias:
            lp["q_bias"], lp["k_bias"], lp["v_bias"] = ("q_heads",), ("kv_heads",), ("kv_heads",)
    out["layers"] = [dict(lp) for _ in range(cfg.n_layers)]
    if pack:  # a packed matrix [N/16, D, 16] keeps the row axis's name; the panel lanes stay whole
        shapes = jax.eval_shape(lambda p: to_decode_layout(cfg, p, fuse), abstract_params(cfg))
        axes = lambda name, ax, x: (*ax, None) if _packable(name, x.shape) else ax
        out = {k: axes(k, v, shapes[k]) for k, v in out.items() if k != "layers"} | {
            "layers": [
                {k: axes(k, v, shp[k]) for k, v in lp.items()}
                for lp, shp in zip(out["layers"], shapes["layers"], strict=True)
            ]
        }
    return out


def _linear(x_MxD, w_NxD, bias_N=None):
    """x @ w.T for an output-major weight, in x's dtype (a packed [N/16, D, 16] weight: the CPU kernel)."""
    if w_NxD.ndim == 3:
        y_MxN = cpu_kernels.linear(x_MxD, w_NxD).astype(x_MxD.dtype)
    else:
        y_MxN = jax.lax.dot_general(x_MxD, w_NxD.astype(x_MxD.dtype), (((1,), (1,)), ((), ())))
    return y_MxN if bias_N is None else y_MxN + bias_N.astype(x_MxD.dtype)


def _qkv(cfg: ModelConfig, lp: dict, h_BxTxD):
    """Query [B, T, H, K], key and value [B, T, G, K] projections (with biases and QK-norm)."""
    b, t, d = h_BxTxD.shape
    G, K = cfg.n_kv_heads, cfg.head_dim
    R = cfg.n_heads // G
    h_MxD = h_BxTxD.reshape(b * t, d)
    if "qkv" in lp:
        qkv = _linear(h_MxD, lp["qkv"], lp.get("qkv_bias")).reshape(b, t, G, R + 2, K)
        q, k, v = qkv[:, :, :, :R].reshape(b, t, G * R, K), qkv[:, :, :, R], qkv[:, :, :, R + 1]
    else:
        q = _linear(h_MxD, lp["q"], lp.get("q_bias")).reshape(b, t, G * R, K)
        k = _linear(h_MxD, lp["k"], lp.get("k_bias")).reshape(b, t, G, K)
        v = _linear(h_MxD, lp["v"], lp.get("v_bias")).reshape(b, t, G, K)
    if cfg.qk_norm:
        q, k = rms_norm(q, lp["q_norm"], cfg.rms_eps), rms_norm(k, lp["k_norm"], cfg.rms_eps)
    return q, k, v


def _mlp_residual(cfg: ModelConfig, lp: dict, x_BxTxD, attn_BxTxHxK):
    """Output projection, residual, MLP block and residual (as in the model's `_layer`)."""
    b, t, d = x_BxTxD.shape
    x_BxTxD = x_BxTxD + _linear(attn_BxTxHxK.reshape(b * t, -1), lp["o"], lp.get("o_bias")).reshape(b, t, d)
    h_MxD = rms_norm(x_BxTxD, lp["mlp_norm"], cfg.rms_eps).reshape(b * t, d)
    if "gate_up" in lp:
        gu_MxFx2 = _linear(h_MxD, lp["gate_up"]).reshape(b * t, -1, 2)
        gate, up = gu_MxFx2[..., 0], gu_MxFx2[..., 1]
    else:
        gate, up = _linear(h_MxD, lp["gate"]), _linear(h_MxD, lp["up"])
    return x_BxTxD + _linear(jax.nn.silu(gate) * up, lp["down"]).reshape(b, t, d)


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
    dt = jnp.dtype(cfg.dtype)
    b, t = tokens_BxT.shape
    positions_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    inv_freq = rope_inv_freq(cfg)
    mask_BxTxS = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    reference = attention.resolve(cfg.attention) == "reference"
    x_BxTxD = dparams["embed"].astype(dt)[tokens_BxT]
    keys, values = [], []
    for i, lp in enumerate(dparams["layers"]):
        h_BxTxD = rms_norm(x_BxTxD, lp["attn_norm"], cfg.rms_eps)
        q, k, v = _qkv(cfg, lp, h_BxTxD)
        q, k = apply_rope(q, positions_BxT, inv_freq), apply_rope(k, positions_BxT, inv_freq)
        k_BxGxTxK, v_BxGxTxK = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        keys.append(k_BxGxTxK)
        values.append(v_BxGxTxK)
        if i + 1 < len(dparams["layers"]):  # the last layer's output is never needed
            if reference:
                attn_BxTxHxK = _attend(q, k_BxGxTxK, v_BxGxTxK, mask_BxTxS)
            else:
                attn_BxTxHxK = attention.attend(cfg.attention, q, k, v, mesh=mesh)
            x_BxTxD = _mlp_residual(cfg, lp, x_BxTxD, attn_BxTxHxK)
    return keys, values


def decode_step(
    cfg: ModelConfig,
    dparams: dict,
    keys: list,
    values: list,
    tokens_B,
    positions_B,
    attention: str = "xla",
    page_layout: paged.PagedLayout | None = None,
    page_table_BxW=None,
    done_B=None,
):
    """One decode step: writes each row's new key/value at its own position, attends to positions <= it.

    Args:
      keys, values: per layer [B, G, S, K] caches, or with `page_layout` [G, pages, page_size, K] page pools
        (updated in place when donated).
      tokens_B: int32 input token per row; positions_B: its absolute position (= cache index).
      attention: "xla" (einsums over the whole row), "cpu_kernel" (`cpu_kernels`: valid positions only) or
        "paged_kernel" (`paged`: the Pallas kernel over the row's pages; needs the next three arguments).
      page_layout, page_table_BxW, done_B: the paged cache's layout, every row's page table, and which rows
        are finished (they must not write: their pages may belong to another sequence by now).

    Returns:
      (logits_BxV float32, keys, values).
    """
    dt = jnp.dtype(cfg.dtype)
    b = tokens_B.shape[0]
    inv_freq = rope_inv_freq(cfg)
    positions_Bx1 = positions_B[:, None]
    if page_layout is None:
        s = keys[0].shape[2]
        mask_Bx1xS = (jnp.arange(s)[None, :] <= positions_Bx1)[:, None, :]
    rows = jnp.arange(b)
    x_Bx1xD = dparams["embed"].astype(dt)[tokens_B][:, None]
    keys, values = list(keys), list(values)
    for i, lp in enumerate(dparams["layers"]):
        h_Bx1xD = rms_norm(x_Bx1xD, lp["attn_norm"], cfg.rms_eps)
        q, k, v = _qkv(cfg, lp, h_Bx1xD)
        q, k = apply_rope(q, positions_Bx1, inv_freq), apply_rope(k, positions_Bx1, inv_freq)
        if page_layout is not None:
            out_BxHxK, keys[i], values[i] = paged.write_and_attend(
                page_layout,
                q[:, 0],
                k[:, 0],
                v[:, 0],
                keys[i],
                values[i],
                page_table_BxW,
                positions_B,
                done_B,
            )
            x_Bx1xD = _mlp_residual(cfg, lp, x_Bx1xD, out_BxHxK[:, None].astype(dt))
            continue
        keys[i] = keys[i].at[rows, :, positions_B].set(k[:, 0].astype(keys[i].dtype))
        values[i] = values[i].at[rows, :, positions_B].set(v[:, 0].astype(values[i].dtype))
        if attention == "cpu_kernel":
            g = keys[i].shape[1]
            q_BxGxRxK = q[:, 0].reshape(b, g, -1, q.shape[-1])
            out = cpu_kernels.decode_attention(q_BxGxRxK, keys[i], values[i], positions_B + 1)
            attn = out.reshape(b, 1, -1, q.shape[-1]).astype(dt)
        else:
            attn = _attend(q, keys[i].astype(dt), values[i].astype(dt), mask_Bx1xS)
        x_Bx1xD = _mlp_residual(cfg, lp, x_Bx1xD, attn)
    x_BxD = rms_norm(x_Bx1xD, dparams["final_norm"], cfg.rms_eps)[:, 0]
    unembed_VxD = dparams["lm_head"] if "lm_head" in dparams else dparams["embed"]
    if unembed_VxD.ndim == 3:  # packed lm head
        logits_BxV = cpu_kernels.linear(x_BxD, unembed_VxD)
    else:
        logits_BxV = jax.lax.dot_general(
            x_BxD, unembed_VxD.astype(dt), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
    return logits_BxV, keys, values
