"""The sampler engine on the sampler submesh: prefill / insert / generate over a ragged, slotted KV cache.

Contract (after JetStream's engine, with one deliberate difference):
  - `prefill(prompt)` -> `Prefix`: the keys/values of the prompt, padded to a prompt bucket
    (`prefill_many(prompts)`: several in one call per bucket, the batch padded to a power of two).
  - `insert(state, prefix, slot, ...)` -> state: the prefix copied into a free slot; the prompt's last
    token becomes the slot's next input (its key/value is recomputed by the first decode step).
  - `generate(state)` -> (state, Round): `steps_per_call` decode steps for every slot in one compiled
    `lax.scan`, with the cache donated. Every generated token (including the first) is sampled here, so
    sampling, logprobs, version stamps and stop handling live in one code path; JetStream samples the
    first token in prefill instead.

Decode state (a dict pytree, sharded by slot over "data" and by KV head over "tensor"):
  k, v: per layer [B, G, S, K]; cache index == absolute position; slot b holds valid entries at 0..pos[b]-1.
  next_token [B]: the token at position pos[b], fed by the next step; last_pos [B]: position of the last
  token the slot may generate; done [B]: the slot is free or finished (it is frozen); key [B, 2]: the row
  key (seed, sample index). Attention masks each slot to its own valid positions.

Static (a new shape compiles): prompt bucket x prefill batch size (all batch sizes of a bucket compile on
its first use), the recompute length bucket, num_slots, steps_per_call, the sampling settings. Dynamic
(arrays): tokens, positions, slot contents, seeds, weights (same tree, shapes and shardings).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_async.model import ModelConfig, abstract_params
from jaxrl_async.sampler import decode, sampling
from jaxrl_async.sampler.config import SamplerConfig
from jaxrl_async.sharding import SAMPLER_RULES


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
        """Compiles nothing yet; validates and converts `params` (already in the sampler layout on `mesh`).

        With `params=None` nothing is allocated: only `compile_generate` may be called (plan checks).
        With `weights_from` (an engine of the same model and mesh, e.g. the sampler's, for a greedy eval
        engine) this engine holds no weights of its own: it decodes with that engine's, and an update of
        either is seen by both. It still has its own decode state (KV cache).

        Raises:
          ValueError: the slot count does not divide over the data axis, the slot length exceeds the model's
            max_seq_len, `params` do not match the model's sampler layout, or `weights_from` has another
            model, mesh or weight layout.
        """
        if cfg.num_slots % mesh.shape["data"]:
            raise ValueError(
                f"num_slots={cfg.num_slots} is not a multiple of the data axis ({mesh.shape['data']})"
            )
        for name in cfg.cpu_kernels:
            if mesh.devices.size != 1 or mesh.devices.flat[0].platform != "cpu":
                raise ValueError(
                    f"SamplerConfig.{name}='cpu_kernel' runs on one CPU device; the sampler mesh has "
                    f"{mesh.devices.size} {mesh.devices.flat[0].platform} device(s) (use {name}='xla')"
                )
            if jnp.dtype(model_cfg.dtype) != jnp.float32:
                # The kernels read float32; other weights/caches would be converted in full every step.
                raise ValueError(
                    f"SamplerConfig.{name}='cpu_kernel' needs a float32 model, got dtype={model_cfg.dtype}"
                )
        if cfg.slot_len > model_cfg.max_seq_len:
            raise ValueError(
                f"slot length {cfg.slot_len} exceeds the model's max_seq_len={model_cfg.max_seq_len}"
            )
        self.model_cfg, self.cfg, self.mesh = model_cfg, cfg, mesh
        pack = cfg.linear == "cpu_kernel"
        # The kernel gains nothing from fused matrices, and slicing the fused outputs apart cost 8% of a
        # batch-32 step (49.9 vs 53.9 ms; equal at batch 1).
        self._layout_kw = dict(fuse=cfg.fuse_projections and not pack, pack=pack)
        self._expected = abstract_params(model_cfg, mesh, SAMPLER_RULES)
        shard = lambda axes, shape=None: SAMPLER_RULES.sharding(mesh, axes, shape)
        to_layout = functools.partial(decode.to_decode_layout, model_cfg, **self._layout_kw)
        dshapes = jax.eval_shape(to_layout, abstract_params(model_cfg))
        dspecs = decode.decode_layout_axes(model_cfg, **self._layout_kw)
        is_axes = lambda x: isinstance(x, tuple)
        self._dparams_sh = jax.tree.map(
            lambda axes, x: shard(axes, x.shape), dspecs, dshapes, is_leaf=is_axes
        )
        b, g, s, k = cfg.num_slots, model_cfg.n_kv_heads, cfg.slot_len, model_cfg.head_dim
        cache_sh = shard(decode.CACHE_AXES, (b, g, s, k))
        row_sh = shard(("batch",), (b,))
        self._state_sh = {
            "k": [cache_sh] * model_cfg.n_layers,
            "v": [cache_sh] * model_cfg.n_layers,
            "next_token": row_sh,
            "pos": row_sh,
            "last_pos": row_sh,
            "done": row_sh,
            "key": shard(("batch", None), (b, 2)),
        }
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
        kv_in = shard((None, "kv_heads", "seq", "head_dim"), (1, g, cfg.max_prompt_len, k))
        self._kv_in_sh = kv_in
        self._executables: dict[int, dict] = {}  # prompt bucket -> batch -> compiled prefill / insert
        self._to_layout = jax.jit(to_layout, out_shardings=self._dparams_sh)
        self._prefill = jax.jit(
            self._prefill_fn, in_shardings=(self._dparams_sh, replicated), out_shardings=(kv_in, kv_in)
        )
        self._insert = jax.jit(
            self._insert_fn,
            donate_argnums=0,
            in_shardings=(self._state_sh, kv_in, kv_in, replicated),
            out_shardings=self._state_sh,
        )
        self._generate = jax.jit(
            self._generate_fn,
            donate_argnums=1,
            in_shardings=(self._dparams_sh, self._state_sh),
            out_shardings=(self._state_sh, round_sh),
        )
        self._recompute = jax.jit(
            self._recompute_fn,
            donate_argnums=1,
            in_shardings=(self._dparams_sh, self._state_sh, shard(("batch", None))),
            out_shardings=self._state_sh,
        )
        self._init_state = jax.jit(self._init_state_fn, out_shardings=self._state_sh)
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
        """`generate` compiled on abstract weights and decode state (nothing allocated; for plan checks)."""
        to_layout = functools.partial(decode.to_decode_layout, self.model_cfg, **self._layout_kw)
        abstract = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
        dshapes = jax.eval_shape(to_layout, abstract_params(self.model_cfg))
        dparams = jax.tree.map(abstract, dshapes, self._dparams_sh)
        state = jax.tree.map(abstract, jax.eval_shape(self._init_state_fn), self._state_sh)
        return self._generate.lower(dparams, state).compile()

    def weight_bytes_per_device(self) -> int:
        """Bytes of the decode-layout weights on each sampler device (shared with `weights_from` engines)."""
        to_layout = functools.partial(decode.to_decode_layout, self.model_cfg, **self._layout_kw)
        shapes = jax.eval_shape(to_layout, abstract_params(self.model_cfg))
        shard_bytes = lambda x, sh: int(np.prod(sh.shard_shape(x.shape))) * x.dtype.itemsize
        return sum(jax.tree.leaves(jax.tree.map(shard_bytes, shapes, self._dparams_sh)))

    def validate(self, params: dict) -> None:
        """Raises ValueError (naming the leaf) unless `params` match this engine's sampler layout."""
        check_params(params, self._expected)

    def fits(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Whether a sequence of this prompt length and generation limit fits one slot."""
        return 1 <= prompt_len <= self.cfg.max_prompt_len and prompt_len + max_new_tokens <= self.cfg.slot_len

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raises ValueError saying why a request cannot fit."""
        c = self.cfg
        if prompt_len < 1:
            raise ValueError("empty prompt: a request needs at least one prompt token")
        if prompt_len > c.max_prompt_len:
            raise ValueError(f"prompt of {prompt_len} tokens exceeds max_prompt_len={c.max_prompt_len}")
        if prompt_len + max_new_tokens > c.slot_len:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds the slot length "
                f"{c.slot_len} (token_budget={c.token_budget} over {c.num_slots} slots)"
            )

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
                keys, values = self._compiled(bucket)[n]["prefill"](self._dparams, tokens)
                for r, i in enumerate(chunk):
                    out[i] = Prefix(keys, values, len(arrays[i]), int(arrays[i][-1]), self.version, r)
        return out

    def _compiled(self, bucket: int) -> dict:
        """{batch: {"prefill", "insert"}} executables for a prompt bucket (compiled on first use)."""
        if bucket not in self._executables:
            abstract = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
            state = jax.tree.map(abstract, jax.eval_shape(self._init_state_fn), self._state_sh)
            row = jax.ShapeDtypeStruct((7,), jnp.int32)
            per_batch = {}
            for n in _batch_buckets(self.cfg.prefill_batch):
                tokens = jax.ShapeDtypeStruct((n, bucket), jnp.int32)
                prefill = self._prefill.lower(self._dparams, tokens).compile()
                kv = jax.eval_shape(self._prefill_fn, self._dparams, tokens)[0]
                kv = [abstract(x, self._kv_in_sh) for x in kv]
                insert = self._insert.lower(state, kv, kv, row).compile()
                per_batch[n] = {"prefill": prefill, "insert": insert}
            self._executables[bucket] = per_batch
        return self._executables[bucket]

    def insert(
        self, state: dict, prefix: Prefix, slot: int, seed: int, sample_index: int, max_new_tokens: int
    ) -> dict:
        """Places a prefix into `slot` (donating `state`); the slot then generates up to max_new_tokens.

        The slot's random stream depends only on (seed, sample_index) and token positions.
        """
        self.check_fits(prefix.prompt_len, max_new_tokens)
        if not 0 <= slot < self.cfg.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.cfg.num_slots})")
        p = prefix.prompt_len
        seed_u32 = np.asarray(seed & 0xFFFFFFFF, np.uint32).view(np.int32)
        row = np.asarray(
            [slot, prefix.last_token, p - 1, p + max_new_tokens - 1, seed_u32, sample_index, prefix.row],
            np.int32,
        )
        insert = self._compiled(prefix.keys[0].shape[2])[prefix.keys[0].shape[0]]["insert"]
        return insert(state, prefix.keys, prefix.values, row)

    def generate(self, state: dict) -> tuple[dict, Round]:
        """`steps_per_call` decode steps for all slots (donating `state`); returns immediately (async)."""
        state, out = self._generate(self._dparams, state)
        return state, Round(**out, version=self.version)

    def recompute_kv(self, state: dict, sequences: list) -> dict:
        """Rebuilds every live slot's cache with the current weights.

        Args:
          sequences: per slot, the tokens whose keys/values the cache holds (prompt + generated tokens,
            without the pending next token), or None for free slots.
        """
        longest = max([len(s) for s in sequences if s is not None] + [1])
        tokens = np.zeros((self.cfg.num_slots, self.cfg.recompute_bucket(longest)), np.int32)
        for b, seq in enumerate(sequences):
            if seq is not None:
                tokens[b, : len(seq)] = seq
        return self._recompute(self._dparams, state, tokens)

    def cache_sizes(self) -> dict[str, int]:
        """Number of compiled executables per jitted entry point (for recompilation checks)."""
        fns = {"generate": self._generate, "recompute": self._recompute}
        compiled = {k: f._cache_size() for k, f in fns.items()}
        n = sum(len(per_batch) for per_batch in self._executables.values())
        return {"prefill": n, "insert": n, **compiled}

    # ----- jitted bodies -----

    def _init_state_fn(self) -> dict:
        m, c = self.model_cfg, self.cfg
        shape = (c.num_slots, m.n_kv_heads, c.slot_len, m.head_dim)
        zeros_b = jnp.zeros((c.num_slots,), jnp.int32)
        return {
            "k": [jnp.zeros(shape, m.dtype) for _ in range(m.n_layers)],
            "v": [jnp.zeros(shape, m.dtype) for _ in range(m.n_layers)],
            "next_token": zeros_b,
            "pos": zeros_b,
            "last_pos": zeros_b,
            "done": jnp.ones((c.num_slots,), bool),
            "key": jnp.zeros((c.num_slots, 2), jnp.uint32),
        }

    def _prefill_fn(self, dparams, tokens_1xT):
        keys, values = decode.prefill_kv(self.model_cfg, dparams, tokens_1xT, self.mesh)
        return keys, values

    def _insert_fn(self, state, keys, values, row):
        slot, last_token, pos, last_pos, src = row[0], row[1], row[2], row[3], row[6]
        seed, index = jax.lax.bitcast_convert_type(row[4:6], jnp.uint32)
        key = sampling.row_keys(seed[None], index[None])[0]

        def put(cache, prefix):
            prefix_1xGxTxK = jax.lax.dynamic_slice_in_dim(prefix, src, 1, axis=0)
            return jax.lax.dynamic_update_slice(cache, prefix_1xGxTxK.astype(cache.dtype), (slot, 0, 0, 0))

        return {
            "k": [put(c, p) for c, p in zip(state["k"], keys, strict=True)],
            "v": [put(c, p) for c, p in zip(state["v"], values, strict=True)],
            "next_token": state["next_token"].at[slot].set(last_token),
            "pos": state["pos"].at[slot].set(pos),
            "last_pos": state["last_pos"].at[slot].set(last_pos),
            "done": state["done"].at[slot].set(False),
            "key": state["key"].at[slot].set(key),
        }

    def _generate_fn(self, dparams, state):
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

    def _recompute_fn(self, dparams, state, tokens_BxT):
        keys, values = decode.prefill_kv(self.model_cfg, dparams, tokens_BxT, self.mesh)
        put = lambda c, p: jax.lax.dynamic_update_slice(c, p.astype(c.dtype), (0, 0, 0, 0))
        return dict(
            state,
            k=[put(c, p) for c, p in zip(state["k"], keys, strict=True)],
            v=[put(c, p) for c, p in zip(state["v"], values, strict=True)],
        )
