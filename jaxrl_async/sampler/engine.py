"""The sampler engine on the sampler submesh: prefill / insert / generate over a ragged KV cache.

Contract (after JetStream's engine, with one deliberate difference):
  - `prefill(prompt)` -> `Prefix`: the keys/values of the prompt, padded to a prompt bucket
    (`prefill_many(prompts)`: several in one call per bucket, the batch padded to a power of two).
  - `insert(state, prefix, slot, ...)` -> state: the prefix copied into a free slot; the prompt's last
    token becomes the slot's next input (its key/value is recomputed by the first decode step).
  - `generate(state)` -> (state, Round): `steps_per_call` decode steps for every slot in one compiled
    `lax.scan`, with the cache donated. Every generated token (including the first) is sampled here, so
    sampling, logprobs, version stamps and stop handling live in one code path; JetStream samples the
    first token in prefill instead.

Decode state (`layout.decode_state`, a dict pytree sharded by slot over "data" and by KV head over
"tensor"): per layer the KV cache, slotted [B, G, S, K] (attention "xla" / "cpu_kernel"; cache index ==
absolute position) or page pools [G, pages, page_size, K] ("paged_kernel", `paged`) addressed through
per-slot page tables that the host owns (`page_table.PageTable`, kept by the loop) and passes to insert /
generate / recompute_kv; and per slot its next token, position, last position, done flag and random key.
Attention masks each slot to its own valid positions.

"auto" kernels are resolved when the engine is built (`kernel_choice`); `cfg` holds the concrete ones.

Static (a new shape compiles): prompt bucket x prefill batch size (all batch sizes of a bucket compile on
its first use), the recompute length bucket, num_slots, steps_per_call, the sampling settings, the
kernels, the page layout. Dynamic (arrays): tokens, positions, slot contents, seeds, page tables, weights
(same tree, shapes and shardings).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_async.model import ModelConfig, abstract_params
from jaxrl_async.sampler import decode, kernel_choice, layout, paged, sampling
from jaxrl_async.sampler.config import SamplerConfig
from jaxrl_async.sampler.page_table import SCRATCH, PagePlanner, PageTable, SlotPlanner, pages_for
from jaxrl_async.sharding import SAMPLER_RULES, tree_shardings


@dataclasses.dataclass(frozen=True)
class Prefix:
    """A prefilled prompt: row `row` of per-layer keys/values [n, G, bucket, K] on the sampler mesh (n
    prompts of one prompt bucket prefilled together)."""

    keys: list
    values: list
    prompt_len: int
    last_token: int
    version: int
    row: int = 0


@dataclasses.dataclass(frozen=True)
class Round:
    """Device outputs of one `generate` call ([steps, B] unless noted); fetched lazily by the host."""

    tokens: jax.Array
    logprobs: jax.Array
    sample_logprobs: jax.Array
    valid: jax.Array  # the slot was live when the token was produced
    done: jax.Array  # [B] after the call
    version: int  # the weight version every token of this round was produced with


def check_params(params, expected) -> None:
    """Validates a parameter tree against abstract params (structure, shapes, dtypes, shardings).

    Raises:
      ValueError naming the first offending leaf.
    """
    got_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    exp = jax.tree_util.tree_leaves_with_path(expected)
    exp_paths = {jax.tree_util.keystr(p) for p, _ in exp}
    if got_paths != exp_paths or jax.tree.structure(params) != jax.tree.structure(expected):
        missing, extra = sorted(exp_paths - got_paths), sorted(got_paths - exp_paths)
        raise ValueError(
            f"update_params: tree structure differs; missing leaves {missing}, unexpected {extra}"
        )
    got = dict((jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(params))
    for path, e in exp:
        name, x = jax.tree_util.keystr(path), got[jax.tree_util.keystr(path)]
        if tuple(x.shape) != tuple(e.shape):
            raise ValueError(
                f"update_params: leaf {name} has shape {tuple(x.shape)}, expected {tuple(e.shape)}"
            )
        if x.dtype != e.dtype:
            raise ValueError(f"update_params: leaf {name} has dtype {x.dtype}, expected {e.dtype}")
        if not isinstance(x, jax.Array) or not x.sharding.is_equivalent_to(e.sharding, len(e.shape)):
            have = getattr(x, "sharding", type(x).__name__)
            raise ValueError(f"update_params: leaf {name} has sharding {have}, expected {e.sharding}")


class _Weights:
    """An engine's decode-layout weights and their policy version (engines built with `weights_from`
    share one, so the weights exist once on the sampler's devices)."""

    def __init__(self, version: int):
        self.dparams = None
        self.version = int(version)


def _batch_buckets(limit: int) -> list[int]:
    """Prefill batch sizes: powers of two below `limit`, then `limit`."""
    out, n = [], 1
    while n < limit:
        out.append(n)
        n *= 2
    return out + [limit]


def _batch_bucket(n: int, limit: int) -> int:
    return next(b for b in _batch_buckets(limit) if b >= n)


class Engine:
    """Prefill / insert / generate for one model on one sampler mesh (axes "data", "tensor")."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        params: dict,
        mesh: Mesh,
        cfg: SamplerConfig,
        version: int = 0,
        weights_from: Engine | None = None,
    ):
        """Validates and converts `params` (already in the sampler layout on `mesh`); resolves "auto" kernels
        (on one float32 CPU device by timing `generate`, which compiles it; see `kernel_choice`).

        With `params=None` nothing is allocated: only `compile_generate` may be called (plan checks).
        With `weights_from` (an engine of the same model and mesh, e.g. the sampler's, for a greedy eval
        engine) this engine holds no weights of its own: it decodes with that engine's, and an update of
        either is seen by both. It still has its own decode state (KV cache).

        Raises:
          ValueError: the slot count does not divide over the data axis, a sequence cannot fit the cache or
            the model's max_seq_len, a kernel cannot run here, `params` do not match the sampler layout,
            or `weights_from` has another model, mesh or weight layout.
        """
        if cfg.num_slots % mesh.shape["data"]:
            raise ValueError(
                f"num_slots={cfg.num_slots} is not a multiple of the data axis ({mesh.shape['data']})"
            )
        runner = None if params is None else functools.partial(_timing_runner, model_cfg, params, mesh)
        self.kernel_choice = kernel_choice.resolve(model_cfg, mesh, cfg, runner)
        cfg = dataclasses.replace(
            cfg, attention=self.kernel_choice.attention, linear=self.kernel_choice.linear
        )
        for name in cfg.cpu_kernels:
            why_not = kernel_choice.cpu_kernels_unavailable(model_cfg, mesh)
            if why_not is not None:
                raise ValueError(
                    f"SamplerConfig.{name}='cpu_kernel' cannot run: {why_not} (use {name}='xla')"
                )
        self.model_cfg, self.cfg, self.mesh = model_cfg, cfg, mesh
        self.paged = cfg.attention == "paged_kernel"
        self.page_layout = paged.engine_layout(mesh, model_cfg, cfg) if self.paged else None
        if not self.paged:
            cfg.check_slotted()
        # Longest sequence (prompt + generated tokens) one slot can hold.
        self.capacity = cfg.max_seq_len if self.paged else cfg.slot_len
        if self.capacity > model_cfg.max_seq_len:
            raise ValueError(
                f"sequence capacity {self.capacity} exceeds the model's max_seq_len={model_cfg.max_seq_len}"
            )
        pack = cfg.linear == "cpu_kernel"
        # The kernel gains nothing from fused matrices, and slicing the fused outputs apart cost 8% of a
        # batch-32 step (49.9 vs 53.9 ms; equal at batch 1).
        self._layout_kw = dict(fuse=cfg.fuse_projections and not pack, pack=pack)
        self._expected = abstract_params(model_cfg, mesh, SAMPLER_RULES)
        shard = lambda axes, shape=None: SAMPLER_RULES.sharding(mesh, axes, shape)
        self._dparams_specs = layout.specs_of(layout.decode_layout(model_cfg, **self._layout_kw))
        self._dparams_sh = tree_shardings(self._dparams_specs, mesh, SAMPLER_RULES)
        b, g, k = cfg.num_slots, model_cfg.n_kv_heads, model_cfg.head_dim
        if self.paged:
            cache = (self.page_layout.pool_shape, layout.POOL_AXES)
        else:
            cache = ((b, g, cfg.slot_len, k), layout.CACHE_AXES)
        self._state_specs = layout.decode_state(model_cfg, b, *cache)
        self._state_sh = tree_shardings(self._state_specs, mesh, SAMPLER_RULES)
        row_sh = shard(("batch",), (b,))
        replicated = NamedSharding(mesh, PartitionSpec())
        steps_sh = shard((None, "batch"), (cfg.steps_per_call, b))
        round_sh = {
            "tokens": steps_sh,
            "logprobs": steps_sh,
            "sample_logprobs": steps_sh,
            "valid": steps_sh,
            "done": row_sh,
        }
        # Prefilled keys/values: replicated over "data" (any slot may take any row), whatever the batch.
        kv_in = shard(layout.PREFIX_AXES, (1, g, cfg.max_prompt_len, k))
        self._kv_in_sh = kv_in
        table_sh = NamedSharding(mesh, PartitionSpec("data", None))  # page tables and per-slot page lists
        self._table_sh = table_sh
        paged_args = (table_sh,) if self.paged else ()
        # name -> signature -> executable: each jitted entry point is compiled ahead of time once per
        # signature (a call with another one fails instead of compiling silently).
        self._executables: dict[str, dict] = {}
        to_layout = functools.partial(layout.to_decode_layout, model_cfg, **self._layout_kw)
        self._to_layout = jax.jit(to_layout, out_shardings=self._dparams_sh)
        self._prefill = jax.jit(
            self._prefill_fn, in_shardings=(self._dparams_sh, replicated), out_shardings=(kv_in, kv_in)
        )
        self._insert = jax.jit(
            self._insert_fn,
            donate_argnums=0,
            in_shardings=(self._state_sh, kv_in, kv_in, replicated, *paged_args),
            out_shardings=self._state_sh,
        )
        self._generate = jax.jit(
            self._generate_fn,
            donate_argnums=1,
            in_shardings=(self._dparams_sh, self._state_sh, *paged_args),
            out_shardings=(self._state_sh, round_sh),
        )
        self._recompute = jax.jit(
            self._recompute_fn,
            donate_argnums=1,
            in_shardings=(self._dparams_sh, self._state_sh, shard(("batch", None)), *paged_args),
            out_shardings=self._state_sh,
        )
        self._release = jax.jit(
            self._release_fn,
            donate_argnums=0,
            in_shardings=(self._state_sh, row_sh),
            out_shardings=self._state_sh,
        )
        self._init_state = jax.jit(
            functools.partial(layout.initialize, self._state_specs), out_shardings=self._state_sh
        )
        if weights_from is None:
            self._weights = _Weights(version)
        else:
            same = (weights_from.model_cfg, weights_from.mesh, weights_from._layout_kw)
            if same != (model_cfg, mesh, self._layout_kw) or params is not None:
                raise ValueError(
                    "weights_from: the engines must share the model config, mesh and weight layout "
                    "(fuse_projections, linear), and params must be None"
                )
            self._weights = weights_from._weights
        if params is not None:
            self.update_params(params, version)

    # ----- public API -----

    @property
    def version(self) -> int:
        """Policy version of the current weights."""
        return self._weights.version

    @property
    def _dparams(self):
        return self._weights.dparams

    def init_state(self) -> dict:
        """A decode state with every slot free."""
        return self._init_state()

    def update_params(self, params: dict, version: int) -> None:
        """Swaps the weights used by the next call (validated: structure, shapes, dtypes, shardings).

        The caller (the loop) decides what happens to the KV of running sequences (keep / recompute).
        """
        self.validate(params)
        # Drop the old layout first: its buffers are freed once in-flight calls finish, so at most the
        # incoming copy and the new layout coexist, never two layouts plus the copy.
        self._weights.dparams = None
        self._weights.dparams = self._to_layout(params)
        self._weights.version = int(version)

    def compile_generate(self):
        """`generate`'s executable, compiled on abstract weights and decode state on first use (a plan check
        calls it with nothing allocated)."""
        return self._executable("generate", None, self._lower_generate)

    def _lower_generate(self):
        tables = self._abstract_tables(self._table_shape()) if self.paged else ()
        return self._generate.lower(self._abstract_dparams(), self._abstract_state(), *tables)

    def weight_bytes_per_device(self) -> int:
        """Bytes of the decode-layout weights on each sampler device (shared with `weights_from` engines)."""
        shard_bytes = lambda x: int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
        return sum(map(shard_bytes, jax.tree.leaves(self._abstract_dparams())))

    def validate(self, params: dict) -> None:
        """Raises ValueError (naming the leaf) unless `params` match this engine's sampler layout."""
        check_params(params, self._expected)

    def fits(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Whether a sequence of this prompt length and generation limit fits one slot."""
        return 1 <= prompt_len <= self.cfg.max_prompt_len and prompt_len + max_new_tokens <= self.capacity

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raises ValueError saying why a request cannot fit."""
        c = self.cfg
        if prompt_len < 1:
            raise ValueError("empty prompt: a request needs at least one prompt token")
        if prompt_len > c.max_prompt_len:
            raise ValueError(f"prompt of {prompt_len} tokens exceeds max_prompt_len={c.max_prompt_len}")
        if prompt_len + max_new_tokens > self.capacity:
            where = (
                f"the longest sequence max_prompt_len + max_new_tokens = {self.capacity}"
                if self.paged
                else f"the slot length {c.slot_len} (token_budget={c.token_budget} over {c.num_slots} slots)"
            )
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds {where}"
            )

    def new_planner(self) -> PagePlanner | SlotPlanner:
        """A fresh page planner for one decode state (the loop keeps one): a `PagePlanner` over empty host
        page tables for the paged cache, the trivial `SlotPlanner` for the slotted one."""
        if not self.paged:
            return SlotPlanner()
        lay = self.page_layout
        table = PageTable(self.cfg.num_slots, lay.data, lay.pages_per_shard, lay.width, lay.page_size)
        to_device = functools.partial(jax.device_put, device=self._table_sh)
        return PagePlanner(table, self.cfg.steps_per_call, self.cfg.prompt_bucket, to_device)

    def prefill(self, prompt_tokens) -> Prefix:
        """Keys/values of a prompt (padded to its bucket), computed with the current weights."""
        return self.prefill_many([prompt_tokens])[0]

    def prefill_many(self, prompts: list) -> list[Prefix]:
        """Prefixes of several prompts: one call per prompt bucket and `prefill_batch` prompts.

        The batch is padded to a power of two; all batch sizes of a prompt bucket are compiled together
        the first time the bucket is used, so admissions of varying size never recompile.
        """
        arrays = [np.asarray(p, np.int32) for p in prompts]
        by_bucket: dict[int, list[int]] = {}
        for i, prompt in enumerate(arrays):
            self.check_fits(len(prompt), 0)
            by_bucket.setdefault(self.cfg.prompt_bucket(len(prompt)), []).append(i)
        out: list = [None] * len(arrays)
        for bucket, idx in by_bucket.items():
            for start in range(0, len(idx), self.cfg.prefill_batch):
                chunk = idx[start : start + self.cfg.prefill_batch]
                n = _batch_bucket(len(chunk), self.cfg.prefill_batch)
                tokens = np.zeros((n, bucket), np.int32)
                for r, i in enumerate(chunk):
                    tokens[r, : len(arrays[i])] = arrays[i]
                keys, values = self._bucket_executables(bucket, n)[0](self._dparams, tokens)
                for r, i in enumerate(chunk):
                    out[i] = Prefix(keys, values, len(arrays[i]), int(arrays[i][-1]), self.version, r)
        return out

    def _bucket_executables(self, bucket: int, n: int) -> tuple:
        """(prefill, insert) executables for `n` prompts of a prompt bucket. A bucket's first use compiles
        them for every prefill batch size, so admissions of varying size never compile later."""
        if (bucket, n) not in self._executables.get("prefill", {}):
            m = self.model_cfg
            for size in _batch_buckets(self.cfg.prefill_batch):
                tokens = jax.ShapeDtypeStruct((size, bucket), jnp.int32)
                self._executable(
                    "prefill",
                    (bucket, size),
                    lambda t=tokens: self._prefill.lower(self._abstract_dparams(), t),
                )
                kv_shape = (size, m.n_kv_heads, bucket, m.head_dim)
                kv = [jax.ShapeDtypeStruct(kv_shape, m.dtype, sharding=self._kv_in_sh)] * m.n_layers
                row = jax.ShapeDtypeStruct((len(layout.InsertRow._fields),), jnp.int32)
                dest = self._abstract_tables(self._dest_shape(bucket)) if self.paged else ()
                lower = lambda kv=kv, row=row, dest=dest: self._insert.lower(
                    self._abstract_state(), kv, kv, row, *dest
                )
                self._executable("insert", (bucket, size), lower)
        return self._executables["prefill"][(bucket, n)], self._executables["insert"][(bucket, n)]

    def _executable(self, name: str, key, lower):
        """Entry point `name` compiled for signature `key` (`lower()` gives its Lowered; called once)."""
        per_key = self._executables.setdefault(name, {})
        exe = per_key.get(key)
        if exe is None:
            exe = per_key[key] = lower().compile()
        return exe

    def _abstract_dparams(self) -> dict:
        return layout.abstract(self._dparams_specs, self._dparams_sh)

    def _abstract_state(self) -> dict:
        return layout.abstract(self._state_specs, self._state_sh)

    def _abstract_tables(self, shape) -> tuple:
        """A paged engine's page-table argument (or `insert`'s `dest`) of `shape`, abstract."""
        return (jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self._table_sh),)

    def insert(
        self,
        state: dict,
        prefix: Prefix,
        slot: int,
        seed: int,
        sample_index: int,
        max_new_tokens: int,
        dest=None,
    ) -> dict:
        """Places a prefix into `slot` (donating `state`); the slot then generates up to max_new_tokens.

        The slot's random stream depends only on (seed, sample_index) and token positions.

        Args:
          dest: paged cache only: int32 [data, ceil(bucket / page_size)], the page of data shard d that
            receives prompt chunk c (`PagePlanner.start` builds it); SCRATCH skips a chunk.
        """
        self.check_fits(prefix.prompt_len, max_new_tokens)
        if not 0 <= slot < self.cfg.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.cfg.num_slots})")
        if self.paged != (dest is not None):
            raise ValueError("insert: pass `dest` pages exactly when the cache is paged")
        p = prefix.prompt_len
        row = layout.InsertRow(
            slot=slot,
            last_token=prefix.last_token,
            pos=p - 1,
            last_pos=p + max_new_tokens - 1,
            seed=int(np.asarray(seed & 0xFFFFFFFF, np.uint32).view(np.int32)),
            sample_index=sample_index,
            src=prefix.row,
        )
        bucket = prefix.keys[0].shape[2]
        insert = self._bucket_executables(bucket, prefix.keys[0].shape[0])[1]
        pages = () if dest is None else (np.asarray(dest, np.int32).reshape(self._dest_shape(bucket)),)
        return insert(state, prefix.keys, prefix.values, row.to_array(), *pages)

    def generate(self, state: dict, page_table=None) -> tuple[dict, Round]:
        """`steps_per_call` decode steps for all slots (donating `state`); returns immediately (async).

        Args:
          page_table: paged cache only: int32 [num_slots, width] (`PageTable.table`, or its device copy);
            every live slot must own pages for the positions this call writes.
        """
        state, out = self.compile_generate()(self._dparams, state, *self._tables(page_table))
        return state, Round(**out, version=self.version)

    def recompute_kv(self, state: dict, sequences: list, page_table=None) -> dict:
        """Rebuilds every live slot's cache with the current weights.

        Args:
          sequences: per slot, the tokens whose keys/values the cache holds (prompt + generated tokens,
            without the pending next token), or None for free slots.
          page_table: paged cache only: as for `generate` (the pages the sequences' positions live in).
        """
        longest = max([len(s) for s in sequences if s is not None] + [1])
        bucket = self.cfg.recompute_bucket(longest, self.capacity)
        tokens = np.zeros((self.cfg.num_slots, bucket), np.int32)
        for b, seq in enumerate(sequences):
            if seq is not None:
                tokens[b, : len(seq)] = seq
        dest = ()
        if self.paged:
            table = np.asarray(page_table)
            n_chunks = pages_for(bucket, self.cfg.page_size)
            dest_BxC = np.full((self.cfg.num_slots, n_chunks), SCRATCH, np.int32)
            for b, seq in enumerate(sequences):
                if seq is not None:
                    n = min(pages_for(len(seq), self.cfg.page_size), n_chunks)
                    dest_BxC[b, :n] = table[b, :n]
            dest = (dest_BxC,)
        host = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # placed by the jit's in_shardings
        lower = lambda: self._recompute.lower(
            self._abstract_dparams(), self._abstract_state(), host(tokens), *map(host, dest)
        )
        return self._executable("recompute", bucket, lower)(self._dparams, state, tokens, *dest)

    def release(self, state: dict, slots: list[int]) -> dict:
        """Marks `slots` finished on the device (donating `state`): they stop writing their cache (used when
        the loop takes a sequence's pages away)."""
        mask = np.zeros((self.cfg.num_slots,), bool)
        mask[list(slots)] = True
        mask_abstract = jax.ShapeDtypeStruct(mask.shape, mask.dtype)
        lower = lambda: self._release.lower(self._abstract_state(), mask_abstract)
        release = self._executable("release", None, lower)
        return release(state, mask)

    def cache_sizes(self) -> dict[str, int]:
        """Number of compiled executables per entry point (for recompilation checks)."""
        names = ("prefill", "insert", "generate", "recompute", "release")
        return {name: len(self._executables.get(name, {})) for name in names}

    def _table_shape(self) -> tuple[int, int]:
        return (self.cfg.num_slots, self.page_layout.width)

    def _dest_shape(self, bucket: int) -> tuple[int, int]:
        return (self.page_layout.data, pages_for(bucket, self.cfg.page_size))

    def _tables(self, page_table) -> tuple:
        if self.paged != (page_table is not None):
            raise ValueError("pass `page_table` exactly when the cache is paged")
        return () if page_table is None else (page_table,)

    # ----- jitted bodies -----

    def _prefill_fn(self, dparams, tokens_1xT):
        keys, values = decode.prefill_kv(self.model_cfg, dparams, tokens_1xT, self.mesh)
        return keys, values

    def _insert_fn(self, state, keys, values, row_array, dest=None):
        row = layout.InsertRow.from_array(row_array)
        slot, src = row.slot, row.src
        seed, index = jax.lax.bitcast_convert_type(jnp.stack([row.seed, row.sample_index]), jnp.uint32)
        key = sampling.row_keys(seed[None], index[None])[0]

        def put(cache, prefix):
            prefix_1xGxTxK = jax.lax.dynamic_slice_in_dim(prefix, src, 1, axis=0)
            return jax.lax.dynamic_update_slice(cache, prefix_1xGxTxK.astype(cache.dtype), (slot, 0, 0, 0))

        if self.paged:
            pools = [
                paged.write_prefix(self.page_layout, kp, vp, pk, pv, src, dest)
                for kp, vp, pk, pv in zip(state["k"], state["v"], keys, values, strict=True)
            ]
            new_k, new_v = [k for k, _ in pools], [v for _, v in pools]
        else:
            new_k = [put(c, p) for c, p in zip(state["k"], keys, strict=True)]
            new_v = [put(c, p) for c, p in zip(state["v"], values, strict=True)]
        return {
            "k": new_k,
            "v": new_v,
            "next_token": state["next_token"].at[slot].set(row.last_token),
            "pos": state["pos"].at[slot].set(row.pos),
            "last_pos": state["last_pos"].at[slot].set(row.last_pos),
            "done": state["done"].at[slot].set(False),
            "key": state["key"].at[slot].set(key),
        }

    def _release_fn(self, state, mask_B):
        return dict(state, done=state["done"] | mask_B)

    def _timing_state_fn(self):
        """Every slot live at mid-capacity (for timing `generate`; the cache contents do not matter)."""
        state = layout.initialize(self._state_specs)
        b, mid = self.cfg.num_slots, self.capacity // 2
        full = lambda v: jnp.full((b,), v, jnp.int32)
        return dict(state, pos=full(mid), last_pos=full(self.capacity - 1), done=jnp.zeros((b,), bool))

    def _generate_fn(self, dparams, state, page_table=None):
        c = self.cfg
        stop = jnp.asarray(c.stop_tokens or (-1,), jnp.int32)

        def one(state, _):
            logits_BxV, keys, values = decode.decode_step(
                self.model_cfg,
                dparams,
                state["k"],
                state["v"],
                state["next_token"],
                state["pos"],
                attention=c.attention,
                page_layout=self.page_layout,
                page_table_BxW=page_table,
                done_B=state["done"],
            )
            new_pos = state["pos"] + 1
            tok, logp, slogp = sampling.sample(
                logits_BxV,
                state["key"],
                new_pos,
                temperature=c.temperature,
                top_k=c.top_k,
                top_p=c.top_p,
                top_p_candidates=c.top_p_candidates,
            )
            was_done = state["done"]
            done = was_done | jnp.any(tok[:, None] == stop[None, :], axis=-1) | (new_pos >= state["last_pos"])
            state = dict(
                state,
                k=keys,
                v=values,
                done=done,
                next_token=jnp.where(was_done, state["next_token"], tok),
                pos=jnp.where(was_done, state["pos"], new_pos),
            )
            return state, (tok, logp, slogp, ~was_done)

        state, (tok, logp, slogp, valid) = jax.lax.scan(one, state, None, length=c.steps_per_call)
        out = {
            "tokens": tok,
            "logprobs": logp,
            "sample_logprobs": slogp,
            "valid": valid,
            "done": state["done"],
        }
        return state, out

    def _recompute_fn(self, dparams, state, tokens_BxT, dest_BxC=None):
        keys, values = decode.prefill_kv(self.model_cfg, dparams, tokens_BxT, self.mesh)
        if self.paged:
            pools = [
                paged.write_sequences(self.page_layout, kp, vp, k, v, dest_BxC)
                for kp, vp, k, v in zip(state["k"], state["v"], keys, values, strict=True)
            ]
            return dict(state, k=[k for k, _ in pools], v=[v for _, v in pools])
        put = lambda c, p: jax.lax.dynamic_update_slice(c, p.astype(c.dtype), (0, 0, 0, 0))
        return dict(
            state,
            k=[put(c, p) for c, p in zip(state["k"], keys, strict=True)],
            v=[put(c, p) for c, p in zip(state["v"], values, strict=True)],
        )


def _timing_runner(model_cfg: ModelConfig, params: dict, mesh: Mesh, cfg: SamplerConfig):
    """An engine for a concrete `cfg` and a function that runs one `generate` call on a state with every
    slot live (what `kernel_choice` times)."""
    eng = Engine(model_cfg, params, mesh, cfg)
    box = [jax.jit(eng._timing_state_fn, out_shardings=eng._state_sh)()]

    def run():
        box[0], rnd = eng.generate(box[0])
        rnd.done.block_until_ready()

    return run
