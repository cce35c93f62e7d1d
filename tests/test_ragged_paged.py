"""The ragged paged attention kernel (`sampler/ragged_paged.py`) in Pallas TPU interpret mode: attention like
the XLA reference, pools written in place exactly as the scatter writes them, the megacore split, the
decode wiring (`paged.write_and_attend`) and its config. Its lowering for `tpu` at math_8b's shapes is in
tests/test_lowering.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.model import presets
from jaxrl_async.sampler import Engine, SamplerConfig, paged, ragged_paged
from jaxrl_async.sampler.page_table import SCRATCH
from jaxrl_async.sharding import make_mesh

MESH1 = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
G, R, K, PS, PAGES, WIDTH = 2, 2, 32, 4, 24, 4  # GQA: 2 query heads a KV head; 4 pages of 4 a sequence


def _tol(dtype) -> float:
    """A few roundings of the pools' dtype: in bfloat16 the queries, the softmax weights (before P.V) and
    the output are each rounded once; in float32 only the summation order differs."""
    return 8 * float(jnp.finfo(dtype).eps)


def _reference(q_TxHxK, k_TxGxK, v_TxGxK, kpool, vpool, cu_q_lens, kv_lens, table_SxW, dest_T):
    """XLA reference (tests): the scatter `paged.write_and_attend` does, then every token attends its
    sequence's pages up to its own position (`paged.reference_attention`, which scales the scores itself:
    pass queries unscaled)."""
    ps = kpool.shape[2]
    page, offset = dest_T // ps, dest_T % ps
    kpool = kpool.at[:, page, offset].set(k_TxGxK.transpose(1, 0, 2).astype(kpool.dtype))
    vpool = vpool.at[:, page, offset].set(v_TxGxK.transpose(1, 0, 2).astype(vpool.dtype))
    t = q_TxHxK.shape[0]
    seq_T = jnp.searchsorted(cu_q_lens, jnp.arange(t), side="right") - 1
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]
    pos_T = kv_lens[seq_T] - q_len[seq_T] + jnp.arange(t) - cu_q_lens[seq_T]
    out = paged.reference_attention(q_TxHxK, kpool, vpool, pos_T + 1, table_SxW[seq_T])
    return out, kpool, vpool


def _case(seed, q_lens, kv_lens, dtype):
    """Random queries, new K/V and pools; sequence s's new tokens are its last q_lens[s] positions, written
    to the pages its table row names (a partial last page when kv_len is not a multiple of PS)."""
    rng = np.random.default_rng(seed)
    s, t = len(q_lens), sum(q_lens)
    table = rng.permutation(np.arange(1, PAGES))[: s * WIDTH].reshape(s, WIDTH).astype(np.int32)
    dest = [
        table[b, p // PS] * PS + p % PS
        for b in range(s)
        for p in range(kv_lens[b] - q_lens[b], kv_lens[b])
    ]  # fmt: skip
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
    q, k, v = normal(t, G * R, K), normal(t, G, K), normal(t, G, K)
    kpool, vpool = normal(G, PAGES, PS, K).astype(dtype), normal(G, PAGES, PS, K).astype(dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    meta = tuple(map(jnp.asarray, (cu, np.asarray(kv_lens, np.int32), table, np.asarray(dest, np.int32))))
    return q, k, v, kpool, vpool, meta


def _check(out, pools, ref, dtype):
    ref_out, ref_k, ref_v = ref
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out), atol=_tol(dtype), rtol=0)
    for got, want in zip(pools, (ref_k, ref_v), strict=True):  # the scatter's pools, bit for bit
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_ragged_queries_attend_like_the_reference_and_the_megacore_split_equals_one_core():
    """Extension chunks of 3 and 5 tokens beside decode rows of 1, in blocks of 2 query tokens (a block
    that runs past its sequence's rows must leave the next sequence's alone); float32."""
    q_lens, kv_lens = [1, 3, 1, 5], [1, 7, 9, 16]
    q, k, v, kpool, vpool, meta = _case(0, q_lens, kv_lens, jnp.float32)
    ref = _reference(q, k, v, kpool, vpool, *meta)
    outs = []
    for megacore in (None, "kv_head"):
        out, kp, vp = ragged_paged.ragged_paged_attention(
            q * K**-0.5, k, v, kpool, vpool, *meta, pages_per_block=2, block_q=2, megacore=megacore,
            interpret=True,
        )  # fmt: skip
        _check(out, (kp, vp), ref, jnp.float32)
        outs.append(np.asarray(out))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_decode_rows_in_bfloat16_match_the_reference_within_its_rounding():
    """One token a sequence (a decode step), block_q 1, lengths 1, mid-page, page-end and mid-table."""
    q_lens, kv_lens = [1, 1, 1, 1], [1, 6, 8, 13]
    q, k, v, kpool, vpool, meta = _case(1, q_lens, kv_lens, jnp.bfloat16)
    ref = _reference(q, k, v, kpool, vpool, *meta)
    out, kp, vp = ragged_paged.ragged_paged_attention(
        q * K**-0.5, k, v, kpool, vpool, *meta, pages_per_block=2, interpret=True
    )
    _check(out, (kp, vp), ref, jnp.bfloat16)


def test_a_decode_step_through_write_and_attend_uses_the_kernel_and_sends_finished_rows_to_scratch():
    """`paged.write_and_attend` with the ragged TPU kernel (interpreted): live rows attend to their
    positions, a finished row writes to the scratch page, and the pools equal the scatter's."""
    q_lens, kv_lens = [1, 1, 1], [3, 9, 16]
    q, k, v, kpool, vpool, (_, _, table, _) = _case(2, q_lens, kv_lens, jnp.float32)
    pos = jnp.asarray(kv_lens, jnp.int32) - 1
    done = jnp.asarray([False, True, False])
    lay = paged.PagedLayout(MESH1, G, K, PS, PAGES, WIDTH, "tpu", True, tpu_kernel="ragged")
    step = jax.jit(paged.write_and_attend, static_argnums=0)
    out, kp, vp = step(lay, q, k, v, kpool, vpool, table, pos, done)
    page = jnp.where(done, SCRATCH, table[jnp.arange(3), pos // PS])
    ref_k = kpool.at[:, page, pos % PS].set(k.transpose(1, 0, 2))
    ref_v = vpool.at[:, page, pos % PS].set(v.transpose(1, 0, 2))
    ref = paged.reference_attention(q, ref_k, ref_v, pos + 1, table)
    _check(out, (kp, vp), (ref, ref_k, ref_v), jnp.float32)


def test_the_ragged_kernel_setting_is_refused_where_it_cannot_apply_naming_the_field():
    with pytest.raises(ValueError, match="SamplerConfig.paged_tpu_kernel='flash' not in"):
        SamplerConfig(paged_tpu_kernel="flash")
    with pytest.raises(ValueError, match="SamplerConfig.paged_tpu_kernel has no effect with attention='xla'"):
        SamplerConfig(attention="xla", paged_tpu_kernel="ragged")
    cfg = SamplerConfig(num_slots=4, max_prompt_len=16, max_new_tokens=16, attention="paged_kernel")
    ragged = dataclasses.replace(cfg, paged_tpu_kernel="ragged")
    with pytest.raises(ValueError, match="SamplerConfig.paged_tpu_kernel='ragged': a TPU kernel, not gpu"):
        Engine(presets.tiny(), None, MESH1, ragged)  # CPU devices: the GPU kernel, interpreted
    eng = Engine(presets.tiny(platform="tpu"), None, MESH1, ragged)
    assert eng.spec.cache.layout.tpu_kernel == "ragged" and "tpu ragged kernel" in eng.spec.cache.describe()
    batch = dataclasses.replace(ragged, megacore="batch")
    with pytest.raises(ValueError, match="SamplerConfig.megacore='batch': the ragged TPU kernel"):
        Engine(presets.tiny(platform="tpu"), None, MESH1, batch)
