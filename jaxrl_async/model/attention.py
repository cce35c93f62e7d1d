"""Causal self-attention for training and prefill, with one implementation per backend.

`ModelConfig.attention` names the implementation:
  reference    masked einsums with float32 scores [B, G, R, T, S] (the model's own `_attention`): the
               ground truth on every backend, and the CPU default. Memory grows with T^2 x heads x 4 bytes.
  dot_product  `jax.nn.dot_product_attention`: implementation="cudnn" (cuDNN flash attention) on a GPU
               with bf16/fp16 inputs, "xla" otherwise. The public API takes no segment ids, so packed
               rows pass a boolean [B, 1, T, S] segment mask, which cuDNN adds as a bf16 bias (and returns
               a bias gradient of the same shape): O(T^2) bytes per row, but not x heads x fp32 scores.
  splash       the TPU splash-attention Pallas kernel (jax.experimental.pallas.ops.tpu): causal, segment
               ids native, no T^2 buffer. On other backends it runs in Pallas interpret mode (tests).
  auto         GPU -> dot_product, TPU -> splash, otherwise reference.

Every implementation masks a packed row the same way for real tokens: a token attends to itself and to
earlier tokens of its own segment. Padding positions (segment id 0) get finite outputs that differ between
implementations and are never used.

Einsum letters as in the model: B batch, T query positions, S key positions, H query heads, G KV heads,
R = H / G, K head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrl_async.model.config import ATTENTION
from jaxrl_async.sharding import rules_for

_NEG_INF = -1e30
_AUTO = {"gpu": "dot_product", "tpu": "splash"}
# Splash block size: 512 is the usual TPU choice for long rows; shorter rows use one block (a multiple
# of 128, the kernel's lane width).
_SPLASH_BLOCK = 512


def resolve(impl: str, platform: str | None = None) -> str:
    """The implementation `impl` runs as on `platform` (default: JAX's default backend)."""
    if impl not in ATTENTION:
        raise ValueError(f"attention={impl!r} not in {ATTENTION}")
    if impl != "auto":
        return impl
    return _AUTO.get(platform or jax.default_backend(), "reference")


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


def attend(impl: str, q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT=None, mesh=None):
    """Causal self-attention of a (packed) row; returns [B, T, H, K] in q's dtype.

    Args:
      impl: a ModelConfig.attention value ("auto" is resolved for the default backend).
      segment_ids_BxT: int32 segment of each position (0 = padding), or None for one sequence per row
        (right padding is then harmless: no real token looks ahead).
      mesh: the mesh the arrays are sharded on (trainer or sampler rules); the splash kernel runs under
        `shard_map` over it, one batch / KV-head shard per device. None = unsharded.
    """
    impl = resolve(impl)
    if impl == "reference":
        b, t = q_BxTxHxK.shape[:2]
        return reference_attention(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, packed_causal_mask(segment_ids_BxT, t, b))
    if impl == "dot_product":
        return _dot_product(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT)
    return _splash_sharded(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT, mesh)


def _dot_product(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT):
    on_gpu = jax.default_backend() == "gpu"
    cudnn = on_gpu and q_BxTxHxK.dtype in (jnp.bfloat16, jnp.float16)
    mask = None
    if segment_ids_BxT is not None:
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


def _splash_local(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT):
    """Splash attention on one device's shard: vmapped over rows and KV heads (a multi-query kernel per
    KV head serves its R query heads). Rows are padded at the end to a whole number of blocks."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    b, t, h, kd = q_BxTxHxK.shape
    g = k_BxTxGxK.shape[2]
    r = h // g
    block = min(_SPLASH_BLOCK, _round_up(t, 128))
    tp = _round_up(t, block)
    kernel = _splash_kernel(tp, r, block, jax.default_backend() != "tpu")
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


def _splash_sharded(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT, mesh):
    """`_splash_local` per device: a Pallas call has no partitioning rule, so under plain jit XLA would
    gather every operand onto each device; `shard_map` keeps rows and KV heads where they are."""
    if mesh is None or mesh.size == 1:
        return _splash_local(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT)
    rules = rules_for(mesh)
    batch = rules.spec(("batch",), q_BxTxHxK.shape[:1], mesh)[0]
    kv_shape = k_BxTxGxK.shape
    # Heads are split only when whole KV groups land on each device (query heads follow their group).
    heads = rules.spec((None, None, "kv_heads", None), kv_shape, mesh)[2]
    qkv = PartitionSpec(batch, None, heads, None)
    seg = PartitionSpec() if segment_ids_BxT is None else PartitionSpec(batch, None)
    fn = jax.shard_map(
        _splash_local,
        mesh=mesh,
        in_specs=(qkv, qkv, qkv, seg),
        out_specs=qkv,
        check_vma=False,
    )
    return fn(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT)
