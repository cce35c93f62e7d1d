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

Decode state (`layout.DecodeState`, sharded by slot over "data" and by KV head over "tensor"): per layer
the KV cache, slotted [B, G, S, K] (attention "xla" / "cpu_kernel"; cache index == absolute position) or
page pools [G, pages, page_size, K] ("paged_kernel", `paged`) addressed through per-slot page tables that
the host owns (`page_table.PagePlanner`, kept by the loop) and passes to insert / generate /
recompute_kv; and per slot its next token, position, last position, done flag and random key. Attention
masks each slot to its own valid positions. The differences between the two caches live in `cache.py`.

"auto" kernels are resolved when the engine is built (`kernel_choice`); `cfg` holds the concrete ones.
Everything static is in the engine's `spec` (`spec.engine_spec`, which says what recompiles); the jitted
bodies are functions of (spec, arrays) in `spec.py`. Each entry point is compiled ahead of time once per
signature (all prefill batch sizes of a prompt bucket on its first use); a call with another signature
fails instead of compiling silently.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_async.model import ModelConfig, init_params
from jaxrl_async.model import lora as lora_lib
from jaxrl_async.sampler import kernel_choice, layout
from jaxrl_async.sampler.config import SamplerConfig
from jaxrl_async.sampler.layout import DecodeState
from jaxrl_async.sampler.page_table import PagePlanner, SlotPlanner
from jaxrl_async.sampler.spec import (
    check_slot_count,
    engine_spec,
    jit_entry_points,
    timing_state_body,
)
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


def _layer_items(params: dict) -> list:
    """(name, array) of every leaf, layer leaves by their name in the layer dict, in a fixed order."""
    top = [(n, x) for n, x in sorted(params.items()) if n != "layers"]
    return top + sorted(params["layers"].items())


class _Weights:
    """An engine's decode-layout weights and their policy version (engines built with `weights_from`
    share one, so the weights exist once on the sampler's devices)."""

    def __init__(self, version: int):
        self.dparams = None
        self.version = int(version)
        self.base = None  # an unmerged LoRA engine: the base leaves last laid out (see update_params)


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
        compile_fn=None,
        time_kernels: bool = False,
        lora=None,
    ):
        """Validates and converts `params` (already in the sampler layout on `mesh`); resolves "auto" kernels
        (on one float32 CPU device by timing `generate`, which compiles it; see `kernel_choice`).

        With `params=None` nothing is allocated until `update_params` brings the first version (the runtime's
        engines), and a compile-only engine (plan checks) calls only `compile_generate`. There is nothing to
        time "auto" kernels with then, and they resolve as on a compile-only engine; `time_kernels=True`
        times them on random weights instead (a decode step costs the same whatever the values).
        With `weights_from` (an engine of the same model and mesh, e.g. the sampler's, for a greedy eval
        engine) this engine holds no weights of its own: it decodes with that engine's, and an update of
        either is seen by both. It still has its own decode state (KV cache).
        With `lora` (a model.lora.LoraConfig; SamplerConfig.lora_apply="unmerged") the layers carry that
        LoRA's adapters unmerged: `params` is the base with the adapters beside it (`model.lora.combine`),
        and `update_adapters` replaces only the adapters.
        `compile_fn` turns each entry point's `jax.stages.Lowered` into its executable (default
        `Lowered.compile`; the runtime may pass a store that keeps them on disk).

        Raises:
          ValueError: the slot count does not divide over the data axis, a sequence cannot fit the cache or
            the model's max_seq_len, a kernel cannot run here, `params` do not match the sampler layout,
            or `weights_from` has another model, mesh or weight layout.
        """
        check_slot_count(mesh, cfg)
        runner = _kernel_timing(model_cfg, params, mesh, time_kernels)
        self.kernel_choice = kernel_choice.resolve(model_cfg, mesh, cfg, runner)
        cfg = cfg.with_kernels(self.kernel_choice.attention, self.kernel_choice.linear)
        self.spec = engine_spec(model_cfg, mesh, cfg, lora)
        self.model_cfg, self.cfg, self.mesh = model_cfg, cfg, mesh
        self._jit = jit_entry_points(self.spec)
        self._compile = compile_fn or (lambda lowered: lowered.compile())
        # name -> signature -> executable (`_executable`).
        self._executables: dict[str, dict] = {}
        if weights_from is None:
            self._weights = _Weights(version)
        else:
            theirs, ours = weights_from.spec, self.spec
            same = (theirs.model_cfg, theirs.mesh, theirs.fuse, theirs.pack, theirs.lora) == (
                model_cfg,
                mesh,
                ours.fuse,
                ours.pack,
                ours.lora,
            )
            if not same or params is not None:
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
    def decode_params(self) -> dict | None:
        """The decode-layout weights (`layout.decode_layout`; shared with `weights_from` engines)."""
        return self._weights.dparams

    @property
    def expected_params(self) -> dict:
        """Abstract parameters (sampler layout: shapes, dtypes, shardings) that `update_params` accepts."""
        return self.spec.expected

    @property
    def paged(self) -> bool:
        """Whether the KV cache is paged (attention="paged_kernel": insert, generate and recompute_kv then
        take the planner's page tables)."""
        return self.spec.cache.paged

    def describe(self) -> str:
        """The kernels the engine resolved and what its KV cache holds, in words (the runtime logs it)."""
        return f"{self.kernel_choice.describe()}; KV cache {self.spec.cache.describe()}"

    @property
    def capacity(self) -> int:
        """Longest sequence (prompt + generated tokens) one slot can hold."""
        return self.spec.capacity

    def init_state(self) -> DecodeState:
        """A decode state with every slot free."""
        return self._executable("init_state", None, lambda: self._jit.init_state.lower())()

    def update_params(self, params: dict, version: int) -> None:
        """Swaps the weights used by the next call (validated: structure, shapes, dtypes, shardings).

        The caller (the loop) decides what happens to the KV of running sequences (keep / recompute).
        An unmerged LoRA engine given the very base arrays it laid out last (`LoraWeights` hands every
        version the one base it received at start) lays out only the adapters, as `update_adapters`.
        """
        self.validate(params)
        if self.spec.lora is not None:
            base = [x for n, x in _layer_items(params) if "_lora_" not in n]
            same = self._weights.base is not None and all(
                a is b for a, b in zip(base, self._weights.base, strict=True)
            )
            if same and self._weights.dparams is not None:
                names = [n for n, _ in _layer_items(params) if "_lora_" in n]
                self._set_adapters({n: params["layers"][n] for n in names}, version)
                return
            self._weights.base = base
        # Drop the old layout first: its buffers are freed once in-flight calls finish, so at most the
        # incoming copy and the new layout coexist, never two layouts plus the copy.
        self._weights.dparams = None
        lower = lambda: self._jit.to_layout.lower(self.spec.expected)
        self._weights.dparams = self._executable("to_layout", None, lower)(params)
        self._weights.version = int(version)

    def update_adapters(self, adapters: dict, version: int) -> None:
        """Replaces only the LoRA adapters of the current weights (an unmerged engine, `lora` given): the
        base's decode layout stays; `adapters` are a version's raw adapters ({"layers": {t_lora_a, ...}},
        any float dtype, on the sampler mesh), laid out and cast here."""
        if self.spec.lora is None or self._weights.dparams is None:
            raise ValueError("update_adapters needs an engine built with lora and its first update_params")
        scaled = lora_lib.combine({"layers": {}}, adapters, self.spec.lora)["layers"]
        self._set_adapters(scaled, version)

    def _set_adapters(self, scaled: dict, version: int) -> None:
        """Lays out adapters whose B is already scaled (`model.lora.combine`) over the current base."""
        adapters = {"layers": scaled}
        key = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(adapters))
        lower = lambda: self._jit.adapters_layout.lower(adapters)
        per_layer = self._executable("adapters_layout", key, lower)(adapters)
        old = self._weights.dparams
        self._weights.dparams = {**old, "layers": [{**o, **n} for o, n in zip(old["layers"], per_layer,
                                                                               strict=True)]}  # fmt: skip
        self._weights.version = int(version)

    def compile_generate(self):
        """`generate`'s executable, compiled on abstract weights and decode state on first use (a plan check
        calls it with nothing allocated)."""
        return self._executable("generate", None, lambda: self._trace_generate().lower())

    def _trace_generate(self) -> jax.stages.Traced:
        s = self.spec
        tables = s.cache.table_args(s.table_sh)
        return self._jit.generate.trace(s.abstract_dparams(), s.abstract_state(), *tables)

    def _trace_bucket(self, bucket: int, size: int) -> tuple[jax.stages.Traced, jax.stages.Traced]:
        """(prefill, insert) traced on abstract arrays for `size` prompts of a prompt bucket."""
        m, s = self.model_cfg, self.spec
        dest = s.cache.dest_args(bucket, s.table_sh)
        row = jax.ShapeDtypeStruct((len(layout.InsertRow._fields),), jnp.int32)
        tokens = jax.ShapeDtypeStruct((size, bucket), jnp.int32)
        kv_shape = (size, m.n_kv_heads, bucket, m.head_dim)
        kv = [jax.ShapeDtypeStruct(kv_shape, m.dtype, sharding=s.kv_in_sh)] * m.n_layers
        prefill = self._jit.prefill.trace(s.abstract_dparams(), tokens)
        return prefill, self._jit.insert.trace(s.abstract_state(), kv, kv, row, *dest)

    def lower_for(self, platforms: tuple[str, ...], bucket: int | None = None) -> dict:
        """The weight-layout conversion, prefill and insert (of `bucket`, default the largest, at the
        largest prefill batch) and generate, lowered for `platforms` (e.g. ("cuda",) or ("tpu",)) on abstract
        arrays, not compiled: a program for an accelerator, built here on CPU devices, whose lowered text
        shows its kernels (tests/test_lowering.py). Build the engine with ModelConfig.platform naming the
        target, so that its kernels are the target's."""
        bucket = self.cfg.max_prompt_len if bucket is None else bucket
        prefill, insert = self._trace_bucket(bucket, self.cfg.prefill_batch)
        traced = {
            "to_layout": self._jit.to_layout.trace(self.spec.expected),
            "prefill": prefill,
            "insert": insert,
            "generate": self._trace_generate(),
        }
        return {name: t.lower(lowering_platforms=tuple(platforms)) for name, t in traced.items()}

    def weight_bytes_per_device(self) -> int:
        """Bytes of the decode-layout weights on each sampler device (shared with `weights_from` engines)."""
        shard_bytes = lambda x: int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
        return sum(map(shard_bytes, jax.tree.leaves(self.spec.abstract_dparams())))

    def validate(self, params: dict) -> None:
        """Raises ValueError (naming the leaf) unless `params` match this engine's sampler layout."""
        check_params(params, self.spec.expected)

    def fits(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Whether a sequence of this prompt length and generation limit fits one slot."""
        return 1 <= prompt_len <= self.cfg.max_prompt_len and prompt_len + max_new_tokens <= self.capacity

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raises ValueError saying why a request cannot fit."""
        if prompt_len < 1:
            raise ValueError("empty prompt: a request needs at least one prompt token")
        if prompt_len > self.cfg.max_prompt_len:
            raise ValueError(
                f"prompt of {prompt_len} tokens exceeds max_prompt_len={self.cfg.max_prompt_len}"
            )
        if prompt_len + max_new_tokens > self.capacity:
            limit = self.spec.cache.limit()
            what = f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens}"
            raise ValueError(f"{what} exceeds {limit}")

    def new_planner(self) -> PagePlanner | SlotPlanner:
        """A fresh planner for one decode state (the loop keeps one): a `PagePlanner` over empty host page
        tables for the paged cache, the trivial `SlotPlanner` for the slotted one."""
        return self.spec.cache.planner(self.spec.table_sh)

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
                keys, values = self._bucket_executables(bucket, n)[0](self.decode_params, tokens)
                for r, i in enumerate(chunk):
                    out[i] = Prefix(keys, values, len(arrays[i]), int(arrays[i][-1]), self.version, r)
        return out

    def _bucket_executables(self, bucket: int, n: int) -> tuple:
        """(prefill, insert) executables for `n` prompts of a prompt bucket. A bucket's first use compiles
        them for every prefill batch size, so admissions of varying size never compile later."""
        if (bucket, n) not in self._executables.get("prefill", {}):
            for size in _batch_buckets(self.cfg.prefill_batch):
                prefill, insert = self._trace_bucket(bucket, size)
                self._executable("prefill", (bucket, size), prefill.lower)
                self._executable("insert", (bucket, size), insert.lower)
        return self._executables["prefill"][(bucket, n)], self._executables["insert"][(bucket, n)]

    def _executable(self, name: str, key, lower):
        """Entry point `name` compiled for signature `key` (`lower()` gives its Lowered; called once)."""
        per_key = self._executables.setdefault(name, {})
        exe = per_key.get(key)
        if exe is None:
            exe = per_key[key] = self._compile(lower())
        return exe

    def insert(
        self,
        state: DecodeState,
        prefix: Prefix,
        slot: int,
        seed: int,
        sample_index: int,
        max_new_tokens: int,
        dest=None,
    ) -> DecodeState:
        """Places a prefix into `slot` (donating `state`); the slot then generates up to max_new_tokens.

        The slot's random stream depends only on (seed, sample_index) and token positions.

        Args:
          dest: paged cache only: int32 [data, ceil(bucket / page_size)], the page of data shard d that
            receives prompt chunk c (`PagePlanner.start` builds it); SCRATCH skips a chunk.
        """
        self.check_fits(prefix.prompt_len, max_new_tokens)
        if not 0 <= slot < self.cfg.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.cfg.num_slots})")
        bucket = prefix.keys[0].shape[2]
        dest_args = self.spec.cache.check_dest(dest, bucket)
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
        insert = self._bucket_executables(bucket, prefix.keys[0].shape[0])[1]
        return insert(state, prefix.keys, prefix.values, row.to_array(), *dest_args)

    def generate(self, state: DecodeState, page_table=None) -> tuple[DecodeState, Round]:
        """`steps_per_call` decode steps for all slots (donating `state`); returns immediately (async).

        Args:
          page_table: paged cache only: int32 [num_slots, width] (`PagePlanner.device_table()`, or the host
            `PageTable.table`); every live slot must own pages for the positions this call writes.
        """
        tables = self.spec.cache.check_table(page_table)
        state, out = self.compile_generate()(self.decode_params, state, *tables)
        return state, Round(**out, version=self.version)

    def recompute_kv(self, state: DecodeState, sequences: list, page_table=None) -> DecodeState:
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
        dest = self.spec.cache.recompute_dest(page_table, sequences, bucket)
        host = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # placed by the jit's in_shardings
        s = self.spec
        lower = lambda: self._jit.recompute.lower(
            s.abstract_dparams(), s.abstract_state(), host(tokens), *map(host, dest)
        )
        return self._executable("recompute", bucket, lower)(self.decode_params, state, tokens, *dest)

    def extend(
        self,
        state: DecodeState,
        slot: int,
        context_len: int,
        observation,
        max_new_tokens: int,
        page_table=None,
    ) -> DecodeState:
        """Appends `observation` to the sequence parked in `slot` and lets the slot generate again (donating
        `state`): a prefill of the observation's tokens on top of the slot's cache, whose cost grows with
        the observation, not the context (`spec.extend_body`).

        Args:
          context_len: tokens the slot's sequence holds now (prompt and everything generated or appended,
            its last sampled token included).
          observation: the tokens to append (at least one).
          max_new_tokens: tokens the slot may generate after it.
          page_table: paged cache only: the host page table (`PagePlanner.host_table()`); the slot must own
            the pages of every position the observation and the next call write (`PagePlanner.extend`).

        Raises:
          ValueError: an empty observation, or a sequence that would not fit the slot.
        """
        obs = np.asarray(observation, np.int32).reshape(-1)
        if obs.size < 1:
            raise ValueError("extend: the observation needs at least one token")
        if context_len < 1 or context_len + obs.size + max_new_tokens > self.capacity:
            raise ValueError(
                f"extend: a context of {context_len} tokens + an observation of {obs.size} + max_new_tokens="
                f"{max_new_tokens} exceeds {self.spec.cache.limit()}"
            )
        if not 0 <= slot < self.cfg.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.cfg.num_slots})")
        bucket = self.cfg.recompute_bucket(int(obs.size), self.capacity)
        tokens = np.zeros((bucket,), np.int32)
        tokens[: obs.size] = obs
        row = np.asarray([slot, obs.size, max_new_tokens], np.int32)
        extra = self.spec.cache.extend_extra(page_table, slot)
        s = self.spec
        host = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
        # The view: a length bucket of the whole sequence (compiled once per bucket pair).
        view = self.cfg.recompute_bucket(context_len + int(obs.size), self.capacity)
        args = (host(tokens), host(row), view, *s.cache.extend_args(s.replicated))
        lower = lambda: self._jit.extend.lower(s.abstract_dparams(), s.abstract_state(), *args)
        exe = self._executable("extend", (bucket, view), lower)
        return exe(self.decode_params, state, tokens, row, *extra)

    def release(self, state: DecodeState, slots: list[int]) -> DecodeState:
        """Marks `slots` finished on the device (donating `state`): they stop writing their cache (used when
        the loop takes a sequence's pages away)."""
        mask = np.zeros((self.cfg.num_slots,), bool)
        mask[list(slots)] = True
        mask_abstract = jax.ShapeDtypeStruct(mask.shape, mask.dtype)
        lower = lambda: self._jit.release.lower(self.spec.abstract_state(), mask_abstract)
        return self._executable("release", None, lower)(state, mask)

    def cache_sizes(self) -> dict[str, int]:
        """Number of compiled executables per entry point (for recompilation checks)."""
        names = ("prefill", "insert", "generate", "recompute", "extend", "release")
        return {name: len(self._executables.get(name, {})) for name in names}


def _kernel_timing(model_cfg: ModelConfig, params: dict | None, mesh: Mesh, time_kernels: bool):
    """What `kernel_choice` times "auto" kernels with (None: nothing, a compile-only engine): `params`, or
    with `params` None and `time_kernels`, one set of random weights in the sampler layout, made when the
    first candidate is timed (never where nothing is timed) and shared by every candidate."""
    if params is not None:
        return functools.partial(_timing_runner, model_cfg, params, mesh)
    if not time_kernels:
        return None
    random_weights = functools.cache(lambda: init_params(model_cfg, jax.random.key(0), mesh, SAMPLER_RULES))
    return lambda cfg: _timing_runner(model_cfg, random_weights(), mesh, cfg)


def _timing_runner(model_cfg: ModelConfig, params: dict, mesh: Mesh, cfg: SamplerConfig):
    """An engine for a concrete `cfg` and a function that runs one `generate` call on a state with every
    slot live (what `kernel_choice` times)."""
    eng = Engine(model_cfg, params, mesh, cfg)
    box = [jax.jit(functools.partial(timing_state_body, eng.spec), out_shardings=eng.spec.state_sh)()]

    def run():
        box[0], rnd = eng.generate(box[0])
        rnd.done.block_until_ready()

    return run
