"""The two KV caches behind one interface, so the engine and the loop carry no paged/slotted branches.

A cache object is static (built once per engine, part of its `EngineSpec`): it says what one layer's K or V
buffer is (`shape`, `axes`), the longest sequence a slot holds (`capacity`), which extra arrays the jitted
entry points take (`table_args` for generate / recompute_kv, `dest_args` for insert), how a prefix and a
batch of re-prefilled sequences are written (`put_prefix`, `write_sequences`), how a decode step attends
(`step_attention`), and which host planner keeps its memory (`planner`).

  - `SlottedCache` (attention "xla" / "cpu_kernel"): per layer [B, G, S, K], cache index == position; a
    slot is all a sequence needs, so there are no tables and the planner is the trivial `SlotPlanner`.
  - `PagedCache` (attention "paged_kernel"): per layer a page pool [G, pages, page_size, K] addressed
    through per-slot page tables that the host owns (`page_table.PagePlanner`); the device math is in
    `paged.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_async.sampler import decode, layout, paged
from jaxrl_async.sampler.config import SamplerConfig
from jaxrl_async.sampler.page_table import SCRATCH, PagePlanner, PageTable, SlotPlanner, pages_for


class SlottedCache:
    """One [B, G, slot_len, K] key and value buffer per layer (slot-major, head-major)."""

    paged = False

    def __init__(self, model_cfg, cfg: SamplerConfig):
        cfg.check_slotted()
        self.cfg = cfg
        self.capacity = cfg.slot_len  # the longest sequence (prompt + generated tokens) one slot holds
        self.shape = (cfg.num_slots, model_cfg.n_kv_heads, cfg.slot_len, model_cfg.head_dim)
        self.axes = layout.CACHE_AXES

    def limit(self) -> str:
        """What bounds a sequence, for errors."""
        c = self.cfg
        return f"the slot length {c.slot_len} (token_budget={c.token_budget} over {c.num_slots} slots)"

    def describe(self) -> str:
        """What the cache holds, in words (logged once per engine)."""
        c = self.cfg
        return f"slotted, {c.num_slots} slots of {c.slot_len} positions (token_budget {c.token_budget})"

    def extra_shardings(self, table_sharding) -> tuple:
        """Shardings of the extra argument of insert, generate and recompute_kv (none)."""
        return ()

    def table_args(self, table_sharding) -> tuple:
        """Abstract extra arguments of generate (none)."""
        return ()

    def dest_args(self, bucket: int, table_sharding) -> tuple:
        """Abstract extra arguments of insert for a prompt bucket (none)."""
        return ()

    def check_dest(self, dest, bucket: int) -> tuple:
        """insert's extra arguments from the planner's `dest` (None for this cache)."""
        if dest is not None:
            raise ValueError("insert: pass `dest` pages exactly when the cache is paged")
        return ()

    def check_table(self, page_table) -> tuple:
        if page_table is not None:
            raise ValueError("pass `page_table` exactly when the cache is paged")
        return ()

    def recompute_dest(self, page_table, sequences: list, bucket: int) -> tuple:
        """recompute_kv's extra arguments (none: sequence b goes to slot b from position 0)."""
        self.check_table(page_table)
        return ()

    def planner(self, table_sharding) -> SlotPlanner:
        return SlotPlanner()

    def put_prefix(self, keys, values, prefix_keys, prefix_values, src, slot, *dest):
        """Row `src` of the per-layer prefix [n, G, T, K] into slot `slot`, positions 0..T-1."""

        def put(cache, prefix):
            prefix_1xGxTxK = jax.lax.dynamic_slice_in_dim(prefix, src, 1, axis=0)
            return jax.lax.dynamic_update_slice(cache, prefix_1xGxTxK.astype(cache.dtype), (slot, 0, 0, 0))

        new_k = [put(c, p) for c, p in zip(keys, prefix_keys, strict=True)]
        return new_k, [put(c, p) for c, p in zip(values, prefix_values, strict=True)]

    def write_sequences(self, keys, values, seq_keys, seq_values, *dest):
        """Per layer [B, G, T, K] keys/values of every slot's sequence at positions 0..T-1 (recompute_kv)."""
        put = lambda c, p: jax.lax.dynamic_update_slice(c, p.astype(c.dtype), (0, 0, 0, 0))
        new_k = [put(c, p) for c, p in zip(keys, seq_keys, strict=True)]
        return new_k, [put(c, p) for c, p in zip(values, seq_values, strict=True)]

    def step_attention(self, attention: str, keys, positions_B, done_B, *table):
        """`decode_step`'s per-layer attention: (K, V buffers of a layer) -> the layer's `attend`."""
        return decode.slotted_attention(attention, positions_B, keys[0].shape[2])

    # ----- extend (a parked slot's sequence grows by an observation) -----

    def extend_args(self, replicated) -> tuple:
        """Abstract extra arguments of extend (none)."""
        return ()

    def extend_extra(self, page_table, slot: int) -> tuple:
        """extend's extra arguments on the host (none)."""
        self.check_table(page_table)
        return ()

    def extend_view(self, buf, slot, view_len: int, *extra):
        """One layer's K or V of `slot`, its first `view_len` positions, as a contiguous row [1, G, L, K]."""
        _, g, _, k = buf.shape
        return jax.lax.dynamic_slice(buf, (slot, 0, 0, 0), (1, g, view_len, k))

    def extend_write(self, buf, new_TxGxK, slot, positions_T, *extra):
        """Writes T new keys (or values) of `slot` at `positions_T` (positions past the slot: dropped)."""
        return buf.at[slot, :, positions_T].set(new_TxGxK.astype(buf.dtype), mode="drop")


class PagedCache:
    """One K and one V page pool [G, data * pages_per_shard, page_size, K] per layer (`paged.py`)."""

    paged = True

    def __init__(self, model_cfg, cfg: SamplerConfig, mesh):
        self.cfg = cfg
        self.layout = paged.engine_layout(mesh, model_cfg, cfg)
        self.capacity = cfg.max_seq_len
        self.shape, self.axes = self.layout.pool_shape, layout.POOL_AXES

    def limit(self) -> str:
        return f"the longest sequence max_prompt_len + max_new_tokens = {self.capacity}"

    def describe(self) -> str:
        """What the cache holds, in words (logged once per engine): the pages, how many sequences of the
        longest length they hold beside the slots that could ask for them (a smaller token_budget admits
        fewer at a time), and the kernel's blocks."""
        lay, c = self.layout, self.cfg
        usable, per_seq = lay.pages_per_shard - 1, pages_for(self.capacity, c.page_size)
        splits, per_block = lay.blocks
        name = f"{lay.impl} {lay.tpu_kernel}" if lay.impl == "tpu" else lay.impl
        kernel = f"{name} kernel" + (", interpreted" if lay.interpret else "")
        kernel += f", megacore over {lay.megacore}" if lay.megacore else ""
        return (
            f"paged, {lay.data} data shard(s) of {usable} pages of {c.page_size} positions and a scratch "
            f"page (token_budget {c.token_budget}): {usable // per_seq} sequences of {self.capacity} "
            f"positions a shard for its {c.num_slots // lay.data} slots; page tables of {lay.width} columns, "
            f"{splits} splits of {per_block}-page blocks ({kernel})"
        )

    def _dest_shape(self, bucket: int) -> tuple[int, int]:
        return (self.layout.data, pages_for(bucket, self.cfg.page_size))

    def extra_shardings(self, table_sharding) -> tuple:
        """insert's `dest`, generate's page table, recompute_kv's destinations: rows over "data"."""
        return (table_sharding,)

    def table_args(self, table_sharding) -> tuple:
        shape = (self.cfg.num_slots, self.layout.width)
        return (jax.ShapeDtypeStruct(shape, jnp.int32, sharding=table_sharding),)

    def dest_args(self, bucket: int, table_sharding) -> tuple:
        return (jax.ShapeDtypeStruct(self._dest_shape(bucket), jnp.int32, sharding=table_sharding),)

    def check_dest(self, dest, bucket: int) -> tuple:
        if dest is None:
            raise ValueError("insert: pass `dest` pages exactly when the cache is paged")
        return (np.asarray(dest, np.int32).reshape(self._dest_shape(bucket)),)

    def check_table(self, page_table) -> tuple:
        if page_table is None:
            raise ValueError("pass `page_table` exactly when the cache is paged")
        return (page_table,)

    def recompute_dest(self, page_table, sequences: list, bucket: int) -> tuple:
        """int32 [B, chunks]: the page of each chunk of slot b's sequence (SCRATCH past its end)."""
        table = np.asarray(self.check_table(page_table)[0])
        n_chunks = pages_for(bucket, self.cfg.page_size)
        dest_BxC = np.full((self.cfg.num_slots, n_chunks), SCRATCH, np.int32)
        for b, seq in enumerate(sequences):
            if seq is not None:
                n = min(pages_for(len(seq), self.cfg.page_size), n_chunks)
                dest_BxC[b, :n] = table[b, :n]
        return (dest_BxC,)

    def planner(self, table_sharding) -> PagePlanner:
        lay = self.layout
        table = PageTable(self.cfg.num_slots, lay.data, lay.pages_per_shard, lay.width, lay.page_size)
        to_device = functools.partial(jax.device_put, device=table_sharding)
        return PagePlanner(table, self.cfg.steps_per_call, self.cfg.prompt_bucket, to_device)

    def put_prefix(self, keys, values, prefix_keys, prefix_values, src, slot, dest_DxC):
        pools = [
            paged.write_prefix(self.layout, kp, vp, pk, pv, src, dest_DxC)
            for kp, vp, pk, pv in zip(keys, values, prefix_keys, prefix_values, strict=True)
        ]
        return [k for k, _ in pools], [v for _, v in pools]

    def write_sequences(self, keys, values, seq_keys, seq_values, dest_BxC):
        pools = [
            paged.write_sequences(self.layout, kp, vp, k, v, dest_BxC)
            for kp, vp, k, v in zip(keys, values, seq_keys, seq_values, strict=True)
        ]
        return [k for k, _ in pools], [v for _, v in pools]

    def step_attention(self, attention: str, keys, positions_B, done_B, table_BxW):
        return decode.paged_attention(self.layout, table_BxW, positions_B, done_B)

    # ----- extend -----

    def extend_args(self, replicated) -> tuple:
        """extend's page list: the slot's pages as pool-global ids [width + 1] (the last: its scratch)."""
        return (jax.ShapeDtypeStruct((self.layout.width + 1,), jnp.int32, sharding=replicated),)

    def extend_extra(self, page_table, slot: int) -> tuple:
        """The slot's page-table row as pool-global page ids (a data shard owns a contiguous range of the
        pool), unused columns and the extra last entry its shard's scratch page."""
        table = np.asarray(self.check_table(page_table)[0])
        shard = slot // (self.cfg.num_slots // self.layout.data)
        base = shard * self.layout.pages_per_shard
        return (np.append(table[slot], SCRATCH).astype(np.int32) + base,)

    def extend_view(self, pool, slot, view_len: int, pages_W1):
        g, k = pool.shape[0], pool.shape[3]
        n_pages = min(pages_for(view_len, self.layout.page_size), pages_W1.shape[0] - 1)
        return pool[:, pages_W1[:n_pages]].reshape(1, g, -1, k)

    def extend_write(self, pool, new_TxGxK, slot, positions_T, pages_W1):
        ps, width = self.layout.page_size, pages_W1.shape[0] - 1
        column_T = positions_T // ps
        page_T = jnp.where(column_T < width, pages_W1[jnp.minimum(column_T, width - 1)], pages_W1[-1])
        return pool.at[:, page_T, positions_T % ps].set(new_TxGxK.transpose(1, 0, 2).astype(pool.dtype))


def make_cache(model_cfg, cfg: SamplerConfig, mesh) -> SlottedCache | PagedCache:
    """The cache of a SamplerConfig with concrete kernels (the one place that tells them apart)."""
    if cfg.attention == "paged_kernel":
        return PagedCache(model_cfg, cfg, mesh)
    return SlottedCache(model_cfg, cfg)
