"""Attention implementations match the reference on packed rows: outputs, loss and gradients, prefill.

"splash" runs here in Pallas interpret mode (the TPU kernel's own code, interpreted on CPU); "dot_product"
runs jax.nn.dot_product_attention's XLA implementation (cuDNN needs a GPU: its packed layout's segment
lengths and offsets are checked against the reference mask here, the kernel itself by
benchmarks/device_check.sh); "blocked" is plain JAX.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.model import attention, init_params, presets
from jaxrl_async.rollouts import Rollout
from jaxrl_async.sampler import decode, layout
from jaxrl_async.sharding import make_mesh
from jaxrl_async.trainer import TrainConfig, create_train_state, loss_and_grads, prepare_batch

sample = Rollout.for_trainer  # the run's record, built as the trainer reads it

FAST = ("dot_product", "blocked", "splash")
MODEL = presets.tiny(vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffw_size=128)


def _packed_row(rng, b=2, t=160, h=4, g=2, k=16):
    q = jnp.asarray(rng.standard_normal((b, t, h, k)), jnp.float32)
    kv = [jnp.asarray(rng.standard_normal((b, t, g, k)), jnp.float32) for _ in range(2)]
    seg = np.zeros((b, t), np.int32)
    for row in range(b):  # a few segments of random length, then padding
        start, sid = 0, 1
        while start < t - 20:
            n = int(rng.integers(5, 60))
            seg[row, start : start + n] = sid
            start, sid = start + n, sid + 1
        seg[row, min(start, t) :] = 0
    return q, kv[0], kv[1], jnp.asarray(seg)


@pytest.mark.parametrize("impl", FAST)
def test_attention_matches_the_reference_on_packed_rows(impl):
    q, k, v, seg = _packed_row(np.random.default_rng(0))
    real = np.asarray(seg > 0)
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32) * real[..., None, None]

    def loss(name, q, k, v):
        return jnp.sum(attention.attend(name, q, k, v, seg) * w)

    out, ref = attention.attend(impl, q, k, v, seg), attention.attend("reference", q, k, v, seg)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=2e-5, rtol=1e-5)
    grads = jax.grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(lambda *a: loss("reference", *a), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=5e-5, rtol=1e-4)
    # One sequence per row (segment_ids=None) is plain causal attention.
    np.testing.assert_allclose(
        np.asarray(attention.attend(impl, q, k, v)),
        np.asarray(attention.attend("reference", q, k, v)),
        atol=2e-5,
        rtol=1e-5,
    )


def _rollouts(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(10):
        p, c = int(rng.integers(2, 10)), int(rng.integers(3, 30))
        out.append(
            sample(
                rng.integers(0, 64, p),
                rng.integers(0, 64, c),
                -4.0 + 0.3 * rng.normal(size=c),
                [0] * c,
                float(i % 3 == 0),
                i // 5,
            )
        )
    return out


@pytest.mark.parametrize("impl", FAST)
def test_train_loss_and_gradients_match_the_reference(impl):
    """The trainer's packed micro-batches (several sequences a row) through the whole model."""
    cfg = TrainConfig(token_budget=96, rows_per_micro=2, minibatches=1)
    params = init_params(MODEL, jax.random.key(0))
    batch = prepare_batch(cfg, _rollouts())
    assert int(np.max(batch.arrays["segment_ids"])) > 1  # rows really are packed
    ref = loss_and_grads(create_train_state(cfg, MODEL, params), batch)
    got = loss_and_grads(create_train_state(cfg, MODEL.replace(attention=impl), params), batch)
    assert float(got[0]) == pytest.approx(float(ref[0]), rel=1e-5, abs=1e-6)
    for g, r in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1]), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-6, rtol=2e-4)


def test_sharded_splash_runs_per_device_and_matches_the_reference():
    """On a (fsdp 2, tensor 2) trainer mesh splash runs under shard_map: rows and KV heads stay split."""
    cfg = TrainConfig(token_budget=96, rows_per_micro=2, minibatches=1)
    params = init_params(MODEL, jax.random.key(1))
    mesh = make_mesh((2, 2), ("fsdp", "tensor"), jax.devices()[:4])
    batch = prepare_batch(cfg, _rollouts(seed=3))
    ref = loss_and_grads(create_train_state(cfg, MODEL, params), batch)
    got = loss_and_grads(create_train_state(cfg, MODEL.replace(attention="splash"), params, mesh), batch)
    assert float(got[0]) == pytest.approx(float(ref[0]), rel=1e-5, abs=1e-6)
    for g, r in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1]), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-6, rtol=2e-4)


@pytest.mark.parametrize("impl", FAST)
def test_prefill_keys_and_values_match_the_reference(impl):
    params = init_params(MODEL, jax.random.key(2))
    dparams = layout.to_decode_layout(MODEL, params, fuse=True)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, (2, 24)), jnp.int32)
    ref_k, ref_v = decode.prefill_kv(MODEL, dparams, tokens)
    got_k, got_v = decode.prefill_kv(MODEL.replace(attention=impl), dparams, tokens)
    for g, r in zip(got_k + got_v, ref_k + ref_v, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5, rtol=1e-5)


def test_auto_picks_by_platform_and_unknown_names_fail():
    assert attention.resolve("auto", "cpu") == "reference"
    assert attention.resolve("auto", "gpu") == "dot_product"
    assert attention.resolve("auto", "tpu") == "splash"
    assert attention.resolve("splash", "cpu") == "splash"
    assert attention.resolve("blocked", "gpu") == "blocked"
    with pytest.raises(ValueError, match="config.model.attention"):
        attention.resolve("flash")
    with pytest.raises(ValueError, match="config.model.attention: 'splash' .* GPU"):
        attention.resolve("splash", "gpu")


def _layout(name: str, t: int) -> np.ndarray:
    """[2, t] segment ids: the layouts a packed row takes."""
    seg = np.zeros((2, t), np.int32)
    if name == "one segment":
        seg[:] = 1
    elif name == "many short":  # 1- to 3-token segments back to back
        lengths = np.tile([1, 2, 3], t)
        ends = np.cumsum(lengths)
        for row in range(2):
            start = 0
            for i, end in enumerate(ends[ends <= t - row]):
                seg[row, start:end] = i + 1
                start = end
    elif name == "ragged":
        seg[0, :7], seg[0, 7 : t - 3], seg[0, t - 3 :] = 1, 2, 3
        seg[1, : t // 2], seg[1, t // 2 :] = 5, 9  # ids need not count from 1
    elif name == "padding tail":
        seg[0, : t // 3], seg[0, t // 3 : t - 40] = 1, 2
        seg[1, :5] = 1  # almost all padding
    return seg


LAYOUTS = ("one segment", "many short", "ragged", "padding tail")


@functools.partial(jax.jit, static_argnames=("block",))
def _blocked_and_reference(q, k, v, seg, w, block):
    """Outputs and (q, k, v) gradients of a weighted sum, blocked and reference (one compile per shape:
    the segment layout is an argument)."""
    mask = attention.packed_causal_mask(seg, q.shape[1], q.shape[0])
    fns = (
        lambda q, k, v: attention.blocked_attention(q, k, v, seg, block=block),
        lambda q, k, v: attention.reference_attention(q, k, v, mask),
    )
    out = []
    for fn in fns:
        loss = functools.partial(lambda f, *a: jnp.sum(f(*a) * w), fn)
        out.append((fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))
    return out


@pytest.mark.parametrize("t,block", [(200, 64), (130, None)])
def test_blocked_attention_equals_the_reference_forward_and_gradients(t, block):
    """Blocked (online-softmax) attention is the reference, at every position, on every segment layout,
    with T a multiple of the block or not."""
    rng = np.random.default_rng(t)
    q = jnp.asarray(rng.standard_normal((2, t, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, t, 2, 16)), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    for name in LAYOUTS:
        seg = jnp.asarray(_layout(name, t))
        (out, grads), (ref, ref_grads) = _blocked_and_reference(q, k, v, seg, w, block)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=1e-5, err_msg=name)
        for g, r in zip(grads, ref_grads, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5, rtol=1e-4, err_msg=name)


def test_blocked_attention_in_bfloat16_stays_close_to_the_float32_reference():
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 300, 4, 16)), jnp.float32) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    seg = jnp.asarray(_layout("ragged", 300)[:1])
    ref = jax.jit(attention.reference_attention)(q, k, v, attention.packed_causal_mask(seg, 300, 1))
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out = jax.jit(functools.partial(attention.blocked_attention, block=128))(*bf, seg)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=3e-2, rtol=3e-2)


def test_blocked_attention_memory_does_not_grow_with_t_squared():
    """The compiled forward+backward of a 4k row: the reference holds [heads, T, T] float32 scores
    (256 MiB here), the blocked version a few [heads, block, block] tiles and O(T) buffers."""
    t, h, kd = 4096, 4, 16
    q = jax.ShapeDtypeStruct((1, t, h, kd), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 2, kd), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def temps(fn):
        loss = lambda q, k, v, s: jnp.sum(fn(q, k, v, s))
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return grad.lower(q, kv, kv, seg).compile().memory_analysis().temp_size_in_bytes

    ref = temps(
        lambda q, k, v, s: attention.reference_attention(q, k, v, attention.packed_causal_mask(s, t, 1))
    )
    blocked = temps(lambda q, k, v, s: attention.blocked_attention(q, k, v, s, block=256))
    assert ref > h * t * t * 4  # the T^2 scores
    assert blocked < 16 * 2**20  # O(T x block): far under one head's T x T scores (64 MiB)


def _mask_from_packed_layout(seqlen_BxM, offsets_BxM1, t):
    """The mask cuDNN's PADDING_CAUSAL packed layout applies: causal within each (offset, length) run."""
    b, m = seqlen_BxM.shape
    mask = np.zeros((b, t, t), bool)
    for row in range(b):
        for j in range(m):
            n, start = int(seqlen_BxM[row, j]), int(offsets_BxM1[row, j])
            if n < 0:
                assert start == -1 and (seqlen_BxM[row, j:] == -1).all()
                break
            mask[row, start : start + n, start : start + n] = np.tril(np.ones((n, n), bool))
        assert offsets_BxM1[row, m] == -1
    return mask


def test_the_cudnn_segment_cap_is_the_packers_only_where_cudnn_runs():
    """max_segments bounds cuDNN's backward workspace (one slot per 4,096 positions, 8 to 64); the packer
    is capped with it only where the packed cuDNN call runs (GPU, bf16/fp16)."""
    assert [attention.max_segments(t) for t in (256, 32768, 65536, 1 << 20)] == [8, 8, 16, 64]
    assert attention.row_segment_cap("auto", jnp.bfloat16, 32768, "gpu") == 8
    assert attention.row_segment_cap("dot_product", "float16", 65536, "gpu") == 16
    assert attention.row_segment_cap("auto", jnp.float32, 32768, "gpu") is None  # XLA's dense path
    assert attention.row_segment_cap("blocked", jnp.bfloat16, 32768, "gpu") is None
    assert attention.row_segment_cap("auto", jnp.bfloat16, 32768, "cpu") is None
    # 32 heads of 128 at 32,768 positions: 1 GiB per slot and row, as measured on an H200.
    assert attention.cudnn_workspace_bytes(1, 32, 32768, 128) == 8 * 2**30


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cudnn_packed_layout_describes_the_reference_mask(layout):
    """The segment lengths and offsets handed to cuDNN mask exactly as the reference does on real tokens;
    a row with more runs than max_segments is counted, so attend() takes the blocked path for it."""
    t = 96
    seg = _layout(layout, t)
    m = attention.max_segments(t)
    packed = jax.jit(attention.packed_layout, static_argnums=1)(jnp.asarray(seg), m)
    seqlen, offsets, count = (np.asarray(x) for x in packed)
    np.testing.assert_array_equal(count, [len(set(row[row != 0])) for row in seg])  # one run per id here
    real = seg != 0
    ref = np.asarray(attention.packed_causal_mask(jnp.asarray(seg), t, 2)) & real[:, :, None]
    if (count <= m).all():
        np.testing.assert_array_equal(_mask_from_packed_layout(seqlen, offsets, t), ref)
    else:
        assert layout == "many short" and count.max() > m  # these rows go to blocked_attention


def test_what_cudnn_leaves_at_padding_never_reaches_the_output_or_the_gradients(monkeypatch):
    """cuDNN's packed layout writes neither the output nor dQ/dK/dV at padding positions. A stand-in for the
    kernel (exact attention on real tokens, NaN wherever cuDNN writes nothing) shows that the packed path's
    loss and gradients are finite and equal the blocked path's, with zero gradients at padding."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    rng = np.random.default_rng(3)
    q, k, v, seg = _packed_row(rng)
    real_BxT = seg != 0
    assert not bool(real_BxT.all())  # the row has padding to leave unwritten
    mask = attention.packed_causal_mask(seg, q.shape[1], q.shape[0]) & real_BxT[:, :, None]

    def unwritten(x):  # what the kernel leaves at padding positions: anything, here NaN
        return jnp.where(real_BxT[:, :, None, None], x, jnp.nan)

    @jax.custom_vjp
    def kernel(q, k, v):
        return unwritten(attention.reference_attention(q, k, v, mask))

    def kernel_fwd(q, k, v):
        return kernel(q, k, v), (q, k, v)

    def kernel_bwd(res, d_out):
        _, vjp = jax.vjp(lambda q, k, v: attention.reference_attention(q, k, v, mask), *res)
        return tuple(unwritten(d) for d in vjp(d_out))

    kernel.defvjp(kernel_fwd, kernel_bwd)
    monkeypatch.setattr(fa, "dot_product_attention", lambda q, k, v, *layout, **kw: kernel(q, k, v))
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32) * real_BxT[:, :, None, None]  # loss: real only

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * w)

    packed = functools.partial(attention._cudnn_packed, segment_ids_BxT=seg)
    blocked = functools.partial(attention.blocked_attention, segment_ids_BxT=seg)
    lp, gp = jax.jit(jax.value_and_grad(functools.partial(loss, packed), argnums=(0, 1, 2)))(q, k, v)
    lb, gb = jax.jit(jax.value_and_grad(functools.partial(loss, blocked), argnums=(0, 1, 2)))(q, k, v)
    assert np.isfinite(float(lp)) and abs(float(lp) - float(lb)) < 1e-3
    for a, b in zip(gp, gb, strict=True):
        assert bool(jnp.isfinite(a).all())
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
        assert not bool(jnp.any(a[~real_BxT] != 0))
