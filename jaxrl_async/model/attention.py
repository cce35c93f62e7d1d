"""Causal self-attention for training and prefill, with one implementation per backend.

`ModelConfig.attention` names the implementation:
  reference    masked einsums with float32 scores [B, G, R, T, S] (the model's own `_attention`): the
               ground truth on every backend, and the CPU default. Memory grows with T^2 x heads x 4 bytes.
  dot_product  `jax.nn.dot_product_attention`: cuDNN flash attention on a GPU with bf16/fp16 inputs, XLA's
               dense implementation otherwise. Packed rows (segment ids) on cuDNN use its packed layout:
               per-row segment lengths and offsets (O(T) int32, no T x T mask or bias, no bias gradient),
               which needs a Hopper or newer GPU; rows with more than `max_segments(T)` segments take the
               blocked path below instead (a `lax.cond`, so the result is always right).
  blocked      flash-style attention in plain JAX: query blocks x key blocks with an online softmax, only
               the blocks on or below the diagonal, and a custom VJP that recomputes the scores from the
               log-sum-exp. Memory O(T x block) per head, correct gradients, any backend.
  splash       the TPU splash-attention Pallas kernel (jax.experimental.pallas.ops.tpu): causal, segment
               ids native, no T^2 buffer. On CPU it runs in Pallas interpret mode (tests, the plan check);
               a GPU cannot run it (an error names config.model.attention).
  auto         GPU -> dot_product, TPU -> splash, otherwise reference.

The platform is ModelConfig.platform when set (a program built here for a GPU or TPU target: the plan
check, tests/test_lowering.py), else JAX's default backend; nothing below asks the backend directly.

Every implementation masks a packed row the same way for real tokens: a token attends to itself and to
earlier tokens of its own segment. Segments are contiguous runs of one id, as packing writes them (the
cuDNN packed layout relies on it). Padding positions (segment id 0) get finite outputs that differ between
implementations and are never used; where the loss ignores them, their gradients are zero.

Einsum letters as in the model: B batch, T query positions, S key positions, H query heads, G KV heads,
R = H / G, K head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxrl_async.model.config import ATTENTION
from jaxrl_async.sharding import rules_for

_NEG_INF = -1e30
_AUTO = {"gpu": "dot_product", "tpu": "splash"}
# Splash block size: 512 is the usual TPU choice for long rows; shorter rows use one block (a multiple
# of 128, the kernel's lane width).
_SPLASH_BLOCK = 512
# Blocked attention: 512 x 512 score tiles for long rows (per head 1 MiB of float32), one smaller block of
# a multiple of 128 for short rows.
_BLOCK = 512
# jax < 0.11 strides the packed layout's KV offsets by the query head count (fixed in 0.11): there, grouped
# KV heads are repeated to the query head count before the packed cuDNN call.
_PACKED_GQA_OK = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)


def target(platform: str | None = None) -> str:
    """The platform kernels are chosen for: `platform` (ModelConfig.platform; "cuda" and "rocm" are "gpu"), or
    JAX's default backend when it is empty. A program lowered here for another target names it, so that
    nothing asks the CPU it is built on."""
    platform = platform or jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


def resolve(impl: str, platform: str | None = None) -> str:
    """The implementation `impl` runs as on `platform` (`target`: default JAX's default backend)."""
    if impl not in ATTENTION:
        raise ValueError(f"config.model.attention: {impl!r} not in {ATTENTION}")
    platform = target(platform)
    if impl == "splash" and platform == "gpu":
        raise ValueError(
            "config.model.attention: 'splash' is the TPU Pallas kernel and cannot run on a GPU; "
            "use 'dot_product' (cuDNN) or 'blocked'"
        )
    if impl != "auto":
        return impl
    return _AUTO.get(platform, "reference")


def reference_attention(q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, mask_BxTxS):
    """Grouped-query attention under a boolean mask, with float32 scores."""
    b, t, h, kd = q_BxTxHxK.shape
    g = k_BxSxGxK.shape[2]
    q_BxTxGxRxK = q_BxTxHxK.reshape(b, t, g, h // g, kd)
    scores = jnp.einsum("btgrk,bsgk->bgrts", q_BxTxGxRxK, k_BxSxGxK, preferred_element_type=jnp.float32)
    scores = scores * (kd**-0.5)
    scores = jnp.where(mask_BxTxS[:, None, None, :, :], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxGxK.dtype)
    out = jnp.einsum("bgrts,bsgk->btgrk", probs, v_BxSxGxK)
    return out.reshape(b, t, h, kd)


def packed_causal_mask(segment_ids_BxT, t: int, b: int):
    """[B, T, T]: causal within a segment; padding (segment 0) attends only to itself."""
    seg = jnp.ones((b, t), jnp.int32) if segment_ids_BxT is None else segment_ids_BxT
    causal_TxS = jnp.tril(jnp.ones((t, t), bool))
    mask = causal_TxS[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
    return mask | jnp.eye(t, dtype=bool)[None]


def attend(impl: str, q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT=None, mesh=None, platform=None):
    """Causal self-attention of a (packed) row; returns [B, T, H, K] in q's dtype.

    Args:
      impl: a ModelConfig.attention value ("auto" is resolved for `platform`).
      platform: ModelConfig.platform, the target the kernel is chosen for ("" / None: the default backend).
      segment_ids_BxT: int32 segment of each position (0 = padding), or None for one sequence per row
        (right padding is then harmless: no real token looks ahead).
      mesh: the mesh the arrays are sharded on (trainer or sampler rules); the splash kernel runs under
        `shard_map` over it, one batch / KV-head shard per device. None = unsharded.
    """
    platform = target(platform)
    impl = resolve(impl, platform)
    if impl == "reference":
        b, t = q_BxTxHxK.shape[:2]
        return reference_attention(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, packed_causal_mask(segment_ids_BxT, t, b))
    if impl == "dot_product":
        return _dot_product(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT, platform)
    if impl == "blocked":
        return blocked_attention(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT)
    return _splash_sharded(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT, mesh, platform != "tpu")


def _dot_product(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT, platform):
    cudnn = uses_cudnn_packed("dot_product", q_BxTxHxK.dtype, platform)
    if cudnn and segment_ids_BxT is not None:
        return _cudnn_packed(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT)
    mask = None
    if segment_ids_BxT is not None:  # XLA's dense implementation: it builds T x S scores anyway
        seg = segment_ids_BxT
        mask = seg[:, None, :, None] == seg[:, None, None, :]  # [B, 1, T, S]; causality via is_causal
    out = jax.nn.dot_product_attention(
        q_BxTxHxK,
        k_BxTxGxK,
        v_BxTxGxK,
        mask=mask,
        is_causal=True,
        implementation="cudnn" if cudnn else "xla",
    )
    return out.astype(q_BxTxHxK.dtype)


def max_segments(t: int) -> int:
    """Segments per row the packed cuDNN call is built for (a static shape): one per 4,096 positions, 8 to
    64. A row with more takes the blocked path; the trainer packs at most this many sequences into a row
    where cuDNN runs (`row_segment_cap`). Kept low because cuDNN's backward on the packed layout holds a
    float32 workspace proportional to it (`cudnn_workspace_bytes`)."""
    return max(8, min(64, t // 4096))


def cudnn_workspace_bytes(rows: int, heads: int, t: int, head_dim: int) -> int:
    """Device bytes of the workspace that cuDNN's packed-layout backward allocates for `rows` rows of `t`
    positions and `heads` query heads (a device's share): 2 x rows x max_segments(t) x heads x t x head_dim
    float32 values. Measured on an H200 (jax 0.11.2, CUDA 13, 2026-12-04): at t = 32,768 and 32 heads of
    128 the compiled temporaries grew by 1.01 GiB per segment slot (9.8 GiB at 8 slots, 34.0 at 32, 130.8
    at 128), the formula's 1.0 GiB; with 12 heads at 128 slots, 49.0 GiB against 48.0."""
    return 2 * rows * max_segments(t) * heads * t * head_dim * 4


def uses_cudnn_packed(impl: str, dtype, platform: str | None = None) -> bool:
    """Whether `attend(impl, ...)` on packed rows of `dtype` runs cuDNN's packed layout on `platform`."""
    platform = target(platform)
    on_cudnn = resolve(impl, platform) == "dot_product" and platform == "gpu"
    return on_cudnn and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)


def row_segment_cap(impl: str, dtype, t: int, platform: str | None = None) -> int | None:
    """The most sequences a trainer row of `t` positions may hold so that cuDNN never falls back to the
    blocked path (`max_segments(t)`), or None where attention takes any number (not cuDNN's packed layout)."""
    return max_segments(t) if uses_cudnn_packed(impl, dtype, platform) else None


def packed_layout(segment_ids_BxT, m: int):
    """cuDNN's packed layout of rows whose segments are contiguous runs (id 0 = padding, never attended).

    Returns (seqlen_BxM, offsets_BxM1, count_B): each run's length and start (-1 past the row's runs, as
    jax's cuDNN wrapper expects), and each row's run count (may exceed m: the caller checks).
    """
    seg = segment_ids_BxT
    prev = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)))
    starts_BxT = (seg != prev) & (seg != 0)
    count_B = jnp.sum(starts_BxT, axis=1, dtype=jnp.int32)
    run_BxT = jnp.cumsum(starts_BxT, axis=1, dtype=jnp.int32) - 1  # run index of each position

    def one_row(starts_T, run_T, real_T):
        offsets = jnp.nonzero(starts_T, size=m, fill_value=-1)[0].astype(jnp.int32)
        lengths = jax.ops.segment_sum(real_T.astype(jnp.int32), jnp.where(real_T, run_T, m), m + 1)[:m]
        valid = jnp.arange(m) < jnp.sum(starts_T)
        return jnp.where(valid, lengths, -1), jnp.pad(
            jnp.where(valid, offsets, -1), (0, 1), constant_values=-1
        )

    seqlen_BxM, offsets_BxM1 = jax.vmap(one_row)(starts_BxT, run_BxT, seg != 0)
    return seqlen_BxM, offsets_BxM1, count_B


def _cudnn_packed(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT):
    """cuDNN flash attention on packed rows through its packed layout (jax's cuDNN wrapper, which the
    public `jax.nn.dot_product_attention` does not expose for packing); rows with more runs than
    `max_segments` fall back to `blocked_attention`."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    b, t, h, kd = q_BxTxHxK.shape
    g = k_BxTxGxK.shape[2]
    m = max_segments(t)
    seqlen_BxM, offsets_BxM1, count_B = packed_layout(segment_ids_BxT, m)
    k, v = k_BxTxGxK, v_BxTxGxK
    if g != h and not _PACKED_GQA_OK:
        k, v = jnp.repeat(k, h // g, axis=2), jnp.repeat(v, h // g, axis=2)

    real_BxTx1x1 = (segment_ids_BxT != 0)[:, :, None, None]

    def cudnn(q, k, v):
        # cuDNN writes nothing at padding positions: neither the output nor, in the backward, dQ/dK/dV, which
        # then hold whatever the buffers held (NaN included). Selecting zeros there on the way in and out
        # makes both the output and the gradients zero at padding (a select drops the unwritten values, where
        # a multiply by 0 would keep a NaN).
        q, k, v = (jnp.where(real_BxTx1x1, x, 0) for x in (q, k, v))
        try:
            out = fa.dot_product_attention(
                q, k, v, None, None, seqlen_BxM, seqlen_BxM, offsets_BxM1, offsets_BxM1,
                scale=kd**-0.5, mask_type=fa.MaskType.PADDING_CAUSAL,
            )  # fmt: skip
        except NotImplementedError as e:  # e.g. the packed layout needs Hopper or newer
            raise ValueError(
                f"config.model.attention: 'dot_product' on packed rows needs cuDNN's packed layout, which "
                f"this GPU cannot run ({e}); use 'blocked'"
            ) from e
        return jnp.where(real_BxTx1x1, out, 0).astype(q.dtype)

    def fallback(q, k, v):
        return blocked_attention(q, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT)

    return jax.lax.cond(jnp.max(count_B) <= m, cudnn, fallback, q_BxTxHxK, k, v)


def _block_mask(seg_q, seg_k, i, j, block):
    """[B, bq, bk]: query block i may see key block j (causal within a segment; padding sees itself)."""
    qpos = i * block + jnp.arange(block)
    kpos = j * block + jnp.arange(block)
    causal = qpos[:, None] >= kpos[None, :]
    same = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_q[:, :, None] != 0)
    return (causal[None] & same) | (qpos[:, None] == kpos[None, :])[None]


def _blocks(t: int, block: int | None) -> tuple[int, int]:
    block = block or min(_BLOCK, _round_up(t, 128))
    return block, _round_up(t, block)


def blocked_attention(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT=None, block: int | None = None):
    """Causal (packed) attention in blocks with an online softmax: O(T x block) memory per head.

    Rows are padded to a whole number of blocks with segment 0. Equal to `reference_attention` under
    `packed_causal_mask` (also at padding positions), forward and gradients.
    """
    b, t, h, kd = q_BxTxHxK.shape
    g = k_BxTxGxK.shape[2]
    block, tp = _blocks(t, block)
    seg = jnp.ones((b, t), jnp.int32) if segment_ids_BxT is None else segment_ids_BxT.astype(jnp.int32)
    pad = ((0, 0), (0, tp - t), (0, 0), (0, 0))
    q_BxTxGxRxK = jnp.pad(q_BxTxHxK, pad).reshape(b, tp, g, h // g, kd)
    out = _flash(block, q_BxTxGxRxK, jnp.pad(k_BxTxGxK, pad), jnp.pad(v_BxTxGxK, pad), jnp.pad(seg, pad[:2]))
    return out[:, :t].reshape(b, t, h, kd).astype(q_BxTxHxK.dtype)


def _slice(x, i, block, axis=1):
    return jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=axis)


def _flash_forward(block, q_BxTxGxRxK, k_BxTxGxK, v_BxTxGxK, seg_BxT):
    b, tp, g, r, kd = q_BxTxGxRxK.shape
    scale = kd**-0.5
    nb = tp // block

    def q_block(i, carry):
        out_BxTxGxRxK, lse_BxGxRxT = carry
        q_i = _slice(q_BxTxGxRxK, i, block)
        seg_i = _slice(seg_BxT, i, block)

        def k_block(j, state):
            m_, l_, acc = state  # [B, G, R, bq], [B, G, R, bq], [B, G, R, bq, K] (float32)
            s = jnp.einsum("bqgrk,bsgk->bgrqs", q_i, _slice(k_BxTxGxK, j, block),
                           preferred_element_type=jnp.float32) * scale  # fmt: skip
            s = jnp.where(
                _block_mask(seg_i, _slice(seg_BxT, j, block), i, j, block)[:, None, None], s, _NEG_INF
            )
            m_new = jnp.maximum(m_, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m_ - m_new)
            pv = jnp.einsum("bgrqs,bsgk->bgrqk", p, _slice(v_BxTxGxK, j, block).astype(jnp.float32))
            return m_new, l_ * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv

        init = (jnp.full((b, g, r, block), _NEG_INF, jnp.float32), jnp.zeros((b, g, r, block), jnp.float32),
                jnp.zeros((b, g, r, block, kd), jnp.float32))  # fmt: skip
        m_, l_, acc = jax.lax.fori_loop(0, i + 1, k_block, init)  # key blocks on or below the diagonal
        o_BxQxGxRxK = (acc / l_[..., None]).transpose(0, 3, 1, 2, 4)
        out_BxTxGxRxK = jax.lax.dynamic_update_slice_in_dim(out_BxTxGxRxK, o_BxQxGxRxK, i * block, axis=1)
        lse_BxGxRxT = jax.lax.dynamic_update_slice_in_dim(lse_BxGxRxT, m_ + jnp.log(l_), i * block, axis=3)
        return out_BxTxGxRxK, lse_BxGxRxT

    init = (jnp.zeros((b, tp, g, r, kd), jnp.float32), jnp.zeros((b, g, r, tp), jnp.float32))
    return jax.lax.fori_loop(0, nb, q_block, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(block, q_BxTxGxRxK, k_BxTxGxK, v_BxTxGxK, seg_BxT):
    return _flash_forward(block, q_BxTxGxRxK, k_BxTxGxK, v_BxTxGxK, seg_BxT)[0]


def _flash_fwd(block, q, k, v, seg):
    out, lse = _flash_forward(block, q, k, v, seg)
    return out, (q, k, v, seg, out, lse)  # O(T) residuals: the scores are recomputed in the backward


def _flash_bwd(block, res, do_BxTxGxRxK):
    q, k, v, seg, out, lse_BxGxRxT = res
    b, tp, g, r, kd = q.shape
    scale = kd**-0.5
    nb = tp // block
    do = do_BxTxGxRxK.astype(jnp.float32)
    delta_BxGxRxT = jnp.einsum("btgrk,btgrk->bgrt", do, out)

    def k_block(j, carry):
        dq_BxTxGxRxK, dk_BxTxGxK, dv_BxTxGxK = carry
        k_j, v_j = _slice(k, j, block).astype(jnp.float32), _slice(v, j, block).astype(jnp.float32)
        seg_j = _slice(seg, j, block)

        def q_block(i, state):
            dq, dk_j, dv_j = state
            q_i = _slice(q, i, block).astype(jnp.float32)
            do_i = _slice(do, i, block)
            s = jnp.einsum("bqgrk,bsgk->bgrqs", q_i, k_j) * scale
            mask = _block_mask(_slice(seg, i, block), seg_j, i, j, block)[:, None, None]
            p = jnp.where(mask, jnp.exp(s - _slice(lse_BxGxRxT, i, block, 3)[..., None]), 0.0)
            dv_j = dv_j + jnp.einsum("bgrqs,bqgrk->bsgk", p, do_i)
            dp = jnp.einsum("bqgrk,bsgk->bgrqs", do_i, v_j)
            ds = p * (dp - _slice(delta_BxGxRxT, i, block, 3)[..., None]) * scale
            dk_j = dk_j + jnp.einsum("bgrqs,bqgrk->bsgk", ds, q_i)
            dq_i = _slice(dq, i, block) + jnp.einsum("bgrqs,bsgk->bqgrk", ds, k_j)
            return jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * block, axis=1), dk_j, dv_j

        zeros = jnp.zeros((b, block, g, kd), jnp.float32)
        dq_BxTxGxRxK, dk_j, dv_j = jax.lax.fori_loop(j, nb, q_block, (dq_BxTxGxRxK, zeros, zeros))
        dk_BxTxGxK = jax.lax.dynamic_update_slice_in_dim(dk_BxTxGxK, dk_j, j * block, axis=1)
        dv_BxTxGxK = jax.lax.dynamic_update_slice_in_dim(dv_BxTxGxK, dv_j, j * block, axis=1)
        return dq_BxTxGxRxK, dk_BxTxGxK, dv_BxTxGxK

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dq, dk, dv = jax.lax.fori_loop(0, nb, k_block, init)
    seg_ct = np.zeros(seg.shape, jax.dtypes.float0)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), seg_ct


_flash.defvjp(_flash_fwd, _flash_bwd)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@functools.lru_cache(maxsize=32)
def _splash_kernel(t: int, r: int, block: int, interpret: bool):
    """A causal multi-query splash kernel for rows of `t` positions and `r` query heads per KV head."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(r)])
    sizes = sk.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    with jax.ensure_compile_time_eval():  # its mask tables are constants, cached across traces
        return sk.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash_local(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT, interpret: bool):
    """Splash attention on one device's shard: vmapped over rows and KV heads (a multi-query kernel per
    KV head serves its R query heads). Rows are padded at the end to a whole number of blocks; `interpret`:
    Pallas interpret mode (a target other than TPU)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    b, t, h, kd = q_BxTxHxK.shape
    g = k_BxTxGxK.shape[2]
    r = h // g
    block = min(_SPLASH_BLOCK, _round_up(t, 128))
    tp = _round_up(t, block)
    kernel = _splash_kernel(tp, r, block, interpret)
    scale = jnp.asarray(kd**-0.5, q_BxTxHxK.dtype)  # the kernel does not scale the scores
    q_BxGxRxTxK = (q_BxTxHxK * scale).reshape(b, t, g, r, kd).transpose(0, 2, 3, 1, 4)
    k_BxGxTxK, v_BxGxTxK = k_BxTxGxK.transpose(0, 2, 1, 3), v_BxTxGxK.transpose(0, 2, 1, 3)
    pad = tp - t
    q_BxGxRxTxK = jnp.pad(q_BxGxRxTxK, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0)))
    k_BxGxTxK = jnp.pad(k_BxGxTxK, ((0, 0), (0, 0), (0, pad), (0, 0)))
    v_BxGxTxK = jnp.pad(v_BxGxTxK, ((0, 0), (0, 0), (0, pad), (0, 0)))
    if segment_ids_BxT is None:
        one = lambda q, k, v, _: kernel(q, k, v)
        seg_BxT = jnp.zeros((b, tp), jnp.int32)  # unused
    else:
        one = lambda q, k, v, s: kernel(q, k, v, segment_ids=sk.SegmentIds(s, s))
        seg_BxT = jnp.pad(segment_ids_BxT, ((0, 0), (0, pad)))  # pads join the padding segment 0
    per_row = jax.vmap(one, in_axes=(0, 0, 0, None))  # over KV heads
    out_BxGxRxTxK = jax.vmap(per_row)(q_BxGxRxTxK, k_BxGxTxK, v_BxGxTxK, seg_BxT)
    out = out_BxGxRxTxK[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, h, kd)
    return out.astype(q_BxTxHxK.dtype)


def _splash_sharded(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT, mesh, interpret: bool):
    """`_splash_local` per device: a Pallas call has no partitioning rule, so under plain jit XLA would
    gather every operand onto each device; `shard_map` keeps rows and KV heads where they are."""
    local = functools.partial(_splash_local, interpret=interpret)
    if mesh is None or mesh.size == 1:
        return local(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT)
    rules = rules_for(mesh)
    batch = rules.spec(("batch",), q_BxTxHxK.shape[:1], mesh)[0]
    kv_shape = k_BxTxGxK.shape
    # Heads are split only when whole KV groups land on each device (query heads follow their group).
    heads = rules.spec((None, None, "kv_heads", None), kv_shape, mesh)[2]
    qkv = PartitionSpec(batch, None, heads, None)
    seg = PartitionSpec() if segment_ids_BxT is None else PartitionSpec(batch, None)
    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(qkv, qkv, qkv, seg),
        out_specs=qkv,
        check_vma=False,
    )
    return fn(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT)
