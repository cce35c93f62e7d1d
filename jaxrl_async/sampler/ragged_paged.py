"""Ragged paged attention for TPU (Pallas/Mosaic) on the sampler's page pools, writing the new K/V in place.

One kernel call takes, per sequence, a ragged number of new query tokens (a decode step: 1 each; an
extension chunk: n), described by scalar-prefetch arrays:
  - cu_q_lens [S + 1]: sequence s owns query rows [cu_q_lens[s], cu_q_lens[s + 1]) (0 rows: skipped);
  - kv_lens [S]: its length once the new tokens are written (they are its last q_len positions);
  - the page table [S, W] (shard-local page ids, `page_table.PageTable`), flattened: a 2-D table in scalar
    memory would pad its rows;
  - dest [T]: flat pool row (page * page_size + offset) that token t's new K and V go to. The caller picks
    it (`paged.write_and_attend` sends finished rows to the scratch page), so writing needs no table walk.

Per (KV head, sequence) grid step the kernel first DMAs the sequence's new K and V rows into the pools, which
are passed in HBM (`memory_space=ANY`) and aliased to the outputs (`input_output_aliases`): XLA hands the
kernel the donated cache buffers and nothing copies a pool. It waits for those writes, then attends causally
(a query at position p sees positions <= p) over the sequence's pages in blocks of `pages_per_block` pages,
double-buffered DMAs from HBM to VMEM, with an online softmax in float32. K/V stay in the pools' dtype (the
JAX `paged_attention` kernel reads them as bfloat16 whatever it is). Scores are not scaled: callers
multiply queries by head_dim ** -0.5, as for the other paged kernels (`paged._attend_local`).

Layout: pools [G, pages, page_size, K] (`paged.PagedLayout.pool_shape`); queries [T, H, K] with query head
h = g * R + r over KV head g (R = H // G, as `paged.reference_attention`); new K/V [T, G, K]. Each KV head's
queries and outputs stay in VMEM for the whole call ([T, R, K]: 64 KiB at math_8b's 64 decode rows of 4
query heads of 128 in bfloat16), and a block of `block_q` query tokens is attended at a time.

Grid (cores, G // cores, S): the leading axis is the megacore split over KV heads (`SamplerConfig.megacore`
resolving to "kv_head"; 1 otherwise). A split over sequences is not offered: both cores would write back
the same per-head output block.

What only a TPU can say: its speed against the JAX kernel with an XLA scatter, and whether Mosaic accepts
the one-row DMA writes (a row is a sub-tile slice of a (page_size, K) tile) when compiling for real; here
it runs in Pallas interpret mode and lowers for `tpu` (tests/test_ragged_paged.py, tests/test_lowering.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # a masked score: finite, so exp(MASK - max) is 0, not NaN


def smem_bytes(seqs: int, width: int, tokens: int) -> int:
    """Scalar-memory bytes of one call's prefetched int32 arrays: cu_q_lens, kv_lens, the page table
    (seqs x width) and the destinations of `tokens` new rows."""
    return 4 * ((seqs + 1) + seqs + seqs * width + tokens)


def _kernel(
    cu_ref, kvlen_ref, table_ref, dest_ref,  # scalar prefetch (SMEM)
    q_ref, newk_hbm, newv_hbm, _kpool_in, _vpool_in,  # inputs; the pools are the aliased outputs' buffers
    out_ref, kpool, vpool,  # outputs
    kbuf, vbuf, sems, write_sems,  # scratch
    *, pages_per_block: int, block_q: int, width: int,
):  # fmt: skip
    heads_per_core = pl.num_programs(1)
    g = pl.program_id(0) * heads_per_core + pl.program_id(1)
    s = pl.program_id(2)
    ps, kd = kpool.shape[2], kpool.shape[3]
    r = q_ref.shape[1]  # the block drops the KV-head axis: [T, R, K]
    bk = pages_per_block * ps
    q_start, q_end, kv_len = cu_ref[s], cu_ref[s + 1], kvlen_ref[s]
    q_len = q_end - q_start
    # Integer division below is lax.div/rem (truncating; every operand is >= 0): jnp's floor division
    # lowers through `sign`, whose Mosaic rule asks the local TPU for its generation.

    @pl.when(s == 0)
    def _():  # this head's output block is resident over the sequences: rows no sequence owns read as 0
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    # 1. The new rows into their pages, in place. Waited for before any page is read: a query attends to
    # its own token's K/V, and later tokens of a chunk to earlier ones.
    def write(t, carry):
        row = pl.ds(lax.rem(dest_ref[t], ps), 1)
        page = lax.div(dest_ref[t], ps)
        copies = [
            pltpu.make_async_copy(new.at[g, pl.ds(t, 1)], pool.at[g, page, row], write_sems.at[i])
            for i, (new, pool) in enumerate(((newk_hbm, kpool), (newv_hbm, vpool)))
        ]
        for c in copies:
            c.start()
        for c in copies:
            c.wait()
        return carry

    lax.fori_loop(q_start, q_end, write, 0)

    # 2. Causal attention of each block of block_q query tokens over the pages it can see.
    def page_copies(block, slot):
        copies = []
        for p in range(pages_per_block):  # pages past the table's used columns are valid ids (masked below)
            page = table_ref[s * width + block * pages_per_block + p]
            copies.append(pltpu.make_async_copy(kpool.at[g, page], kbuf.at[slot, p], sems.at[0, slot]))
            copies.append(pltpu.make_async_copy(vpool.at[g, page], vbuf.at[slot, p], sems.at[1, slot]))
        return copies

    def q_block(j, carry):
        first = q_start + j * block_q  # query rows [first, first + block_q); past q_end: the next sequence's
        q = q_ref[pl.ds(first, block_q)].reshape(block_q * r, kd)
        # Row i * r + h is token i's head h; token i sits at position kv_len - q_len + j * block_q + i.
        pos0 = kv_len - q_len + j * block_q
        q_pos = pos0 + lax.div(lax.broadcasted_iota(jnp.int32, (block_q * r, bk), 0), r)
        seen = jnp.minimum(kv_len, pos0 + block_q)  # keys the block's last token sees
        n_blocks = lax.div(seen + bk - 1, bk)
        for c in page_copies(0, 0):
            c.start()

        def kv_block(i, state):
            m, denom, acc = state
            slot = lax.rem(i, 2)

            @pl.when(i + 1 < n_blocks)
            def _():  # the next block's pages load while this one computes
                for c in page_copies(i + 1, 1 - slot):
                    c.start()

            for c in page_copies(i, slot):
                c.wait()
            k = kbuf[slot].reshape(bk, kd)
            v = vbuf[slot].reshape(bk, kd)
            scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            k_pos = i * bk + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
            scores = jnp.where(k_pos <= q_pos, scores, MASK)
            m_new = jnp.maximum(m, scores.max(axis=1, keepdims=True))
            p = jnp.exp(scores - m_new)
            alpha = jnp.exp(m - m_new)
            denom = alpha * denom + p.sum(axis=1, keepdims=True)
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            return m_new, denom, alpha * acc + pv

        init = (
            jnp.full((block_q * r, 1), MASK, jnp.float32),
            jnp.zeros((block_q * r, 1), jnp.float32),
            jnp.zeros((block_q * r, kd), jnp.float32),
        )
        _, denom, acc = lax.fori_loop(0, n_blocks, kv_block, init)
        out = (acc / denom).reshape(block_q, r, kd).astype(out_ref.dtype)
        if block_q > 1:  # rows past q_end keep what they hold (the next sequence writes them after this one)
            own = (first + lax.broadcasted_iota(jnp.int32, out.shape, 0)) < q_end
            out = jnp.where(own, out, out_ref[pl.ds(first, block_q)])
        out_ref[pl.ds(first, block_q)] = out
        return carry

    lax.fori_loop(0, lax.div(q_len + block_q - 1, block_q), q_block, 0)


def ragged_paged_attention(
    q_TxHxK,
    k_TxGxK,
    v_TxGxK,
    kpool,
    vpool,
    cu_q_lens,
    kv_lens,
    table_SxW,
    dest_T,
    *,
    pages_per_block: int,
    block_q: int = 1,
    megacore: str | None = None,
    interpret: bool = False,
):
    """Writes every token's new K/V into pool row dest[t] (in place) and attends its sequence's positions
    up to its own (module doc).

    Args:
      q_TxHxK: queries, already multiplied by head_dim ** -0.5; cast to the pools' dtype.
      k_TxGxK, v_TxGxK: the tokens' new keys and values (cast to the pools' dtype).
      kpool, vpool: [G, pages, page_size, K] pools (donate them: the kernel updates their buffers).
      cu_q_lens [S + 1], kv_lens [S], table_SxW, dest_T: int32 (module doc).
      pages_per_block: pages per K/V block; divides the table width.
      block_q: query tokens attended together (1 for decode).
      megacore: "kv_head" (split the KV heads over a megacore chip's two TensorCores) or None.
      interpret: run in Pallas TPU interpret mode (CPU).

    Returns:
      (attention [T, H, K] in the pools' dtype, kpool, vpool).
    """
    t, h, kd = q_TxHxK.shape
    g, _, ps, _ = kpool.shape
    seqs, width = table_SxW.shape
    if megacore not in (None, "kv_head"):
        raise ValueError(f"megacore={megacore!r}: the ragged kernel splits over KV heads only (or None)")
    cores = 2 if megacore else 1
    if h % g or g % cores or width % pages_per_block or block_q < 1:
        raise ValueError(
            f"ragged paged attention: {h} query heads over {g} KV heads on {cores} core(s), table width "
            f"{width} in blocks of {pages_per_block} pages, block_q={block_q}"
        )
    r, dt = h // g, kpool.dtype
    t_pad = t + block_q - 1  # the last block of a sequence may read up to block_q - 1 rows past T
    q = q_TxHxK.astype(dt).reshape(t, g, r, kd).transpose(1, 0, 2, 3)
    q = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
    new_k, new_v = (x.astype(dt).transpose(1, 0, 2) for x in (k_TxGxK, v_TxGxK))
    per_core = g // cores
    head_block = pl.BlockSpec((None, t_pad, r, kd), lambda c, gi, s, *_: (c * per_core + gi, 0, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    buf = pltpu.VMEM((2, pages_per_block, ps, kd), dt)
    kernel = functools.partial(_kernel, pages_per_block=pages_per_block, block_q=block_q, width=width)
    params = pltpu.InterpretParams(num_cores_or_threads=cores) if interpret else False
    out, kpool, vpool = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            in_specs=[head_block, hbm, hbm, hbm, hbm],
            out_specs=[head_block, hbm, hbm],
            grid=(cores, per_core, seqs),
            scratch_shapes=[buf, buf, pltpu.SemaphoreType.DMA((2, 2)), pltpu.SemaphoreType.DMA((2,))],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, dt),
            jax.ShapeDtypeStruct(kpool.shape, dt),
            jax.ShapeDtypeStruct(vpool.shape, dt),
        ],
        input_output_aliases={7: 1, 8: 2},  # operands: 4 scalar-prefetch arrays, q, new K, new V, the pools
        interpret=params,
        name="ragged_paged_attention",
    )(
        cu_q_lens.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        table_SxW.astype(jnp.int32).reshape(-1),
        dest_T.astype(jnp.int32),
        q,
        new_k,
        new_v,
        kpool,
        vpool,
    )
    return out[:, :t].transpose(1, 0, 2, 3).reshape(t, h, kd), kpool, vpool

