"""What an engine compiles: its static `EngineSpec` and the jitted bodies, functions of (spec, arrays).

Static (part of the spec or of an array's shape; a new value compiles): the model config, the mesh, the
SamplerConfig with concrete kernels (num_slots, steps_per_call, the sampling settings, stop tokens, the
kernels), the cache kind and its layout (slot length, or page size, pages per shard and table width), the
weight layout (fused / packed), every sharding; per call, the prompt bucket x prefill batch size and the
recompute length bucket. Dynamic (arrays; never compile): tokens, positions, slot contents, seeds, page
tables and insert destinations, the weights (same tree, shapes and shardings).

The bodies close over nothing but the spec, so `Engine` only binds them (`jit_entry_points`) and keeps the
executables, and the paged/slotted differences live in the spec's cache object (`cache.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_async.model import ModelConfig, abstract_params
from jaxrl_async.model import lora as lora_lib
from jaxrl_async.sampler import decode, kernel_choice, layout, sampling
from jaxrl_async.sampler.cache import PagedCache, SlottedCache, make_cache
from jaxrl_async.sampler.config import SamplerConfig
from jaxrl_async.sampler.layout import DecodeState
from jaxrl_async.sharding import SAMPLER_RULES, tree_shardings


@dataclasses.dataclass(frozen=True, eq=False)
class EngineSpec:
    """Everything static about an engine (see the module doc); built by `engine_spec`.

    Attributes:
      cfg: the SamplerConfig with concrete kernels.
      cache: the KV cache (`SlottedCache` or `PagedCache`).
      fuse, pack: the decode weight layout (fused q|k|v and gate|up; CPU-kernel panels).
      expected: abstract parameters (sampler layout) that weight updates are validated against.
      dparams_specs, dparams_sh: the decode-layout weights' ParamSpecs and shardings.
      state_specs, state_sh: the decode state's ParamSpecs and shardings (`DecodeState`s).
      row_sh, round_sh: per-slot rows [B] and generate's outputs.
      kv_in_sh: prefilled keys/values (replicated over "data": any slot may take any row).
      table_sh: page tables and insert destinations (rows over "data").
      lora: the model.lora.LoraConfig whose adapters the layers carry unmerged (lora_apply="unmerged"),
        or None: `expected` then includes the adapter leaves (B pre-scaled, `model.lora.combine`).
    """

    model_cfg: ModelConfig
    cfg: SamplerConfig
    mesh: Mesh
    cache: SlottedCache | PagedCache
    fuse: bool
    pack: bool
    expected: dict
    dparams_specs: dict
    dparams_sh: dict
    state_specs: DecodeState
    state_sh: DecodeState
    row_sh: NamedSharding
    round_sh: dict
    kv_in_sh: NamedSharding
    table_sh: NamedSharding
    replicated: NamedSharding
    lora: object = None

    @property
    def capacity(self) -> int:
        """Longest sequence (prompt + generated tokens) one slot can hold."""
        return self.cache.capacity

    def abstract_dparams(self) -> dict:
        return layout.abstract(self.dparams_specs, self.dparams_sh)

    def abstract_state(self) -> DecodeState:
        return layout.abstract(self.state_specs, self.state_sh)


def spans_processes(mesh: Mesh) -> bool:
    """Whether `mesh` has devices of several processes (a replica over several hosts: its processes then
    run every call together)."""
    return len({d.process_index for d in mesh.devices.flat}) > 1


def check_slot_count(mesh: Mesh, cfg: SamplerConfig) -> None:
    if cfg.num_slots % mesh.shape["data"]:
        raise ValueError(
            f"num_slots={cfg.num_slots} is not a multiple of the data axis ({mesh.shape['data']})"
        )


def _expected(model_cfg: ModelConfig, mesh: Mesh, lora) -> dict:
    """Abstract weights that `update_params` takes: the model's, plus its adapters when unmerged."""
    base = abstract_params(model_cfg, mesh, SAMPLER_RULES)
    if lora is None:
        return base
    specs = lora_lib.adapter_specs(model_cfg, lora)["layers"]
    specs = {n: dataclasses.replace(s, dtype=model_cfg.param_dtype) for n, s in specs.items()}
    sh = tree_shardings(specs, mesh, SAMPLER_RULES)
    return {**base, "layers": {**base["layers"], **{n: specs[n].abstract(sh[n]) for n in specs}}}


def engine_spec(model_cfg: ModelConfig, mesh: Mesh, cfg: SamplerConfig, lora=None) -> EngineSpec:
    """The spec of an engine for a SamplerConfig with concrete kernels (pure: allocates nothing).

    Raises:
      ValueError: the slot count does not divide over the data axis, a CPU kernel cannot run here, or a
        sequence cannot fit the cache or the model's max_seq_len.
    """
    check_slot_count(mesh, cfg)
    for name in cfg.cpu_kernels:
        why_not = kernel_choice.cpu_kernels_unavailable(model_cfg, mesh)
        if why_not is not None:
            raise ValueError(f"SamplerConfig.{name}='cpu_kernel' cannot run: {why_not} (use {name}='xla')")
    cache = make_cache(model_cfg, cfg, mesh)
    if cache.capacity > model_cfg.max_seq_len:
        raise ValueError(
            f"sequence capacity {cache.capacity} exceeds the model's max_seq_len={model_cfg.max_seq_len}"
        )
    pack = cfg.linear == "cpu_kernel"
    # The kernel gains nothing from fused matrices, and slicing the fused outputs apart cost 8% of a
    # batch-32 step (49.9 vs 53.9 ms; equal at batch 1).
    fuse = cfg.fuse_projections and not pack
    shard = lambda axes, shape=None: SAMPLER_RULES.sharding(mesh, axes, shape)
    dparams_specs = layout.specs_of(layout.decode_layout(model_cfg, fuse=fuse, pack=pack, lora=lora))
    state_specs = layout.decode_state(model_cfg, cfg.num_slots, cache.shape, cache.axes)
    b, steps = cfg.num_slots, cfg.steps_per_call
    steps_sh = shard((None, "batch"), (steps, b))
    row_sh = shard(("batch",), (b,))
    round_sh = dict.fromkeys(("tokens", "logprobs", "sample_logprobs", "valid"), steps_sh) | {"done": row_sh}
    if spans_processes(mesh):
        # Every process of the replica reads each round on the host: the program gathers it (k x B values
        # per field) onto every device instead of leaving slices on other hosts, which no process could
        # read without another computation that every one of them enters.
        round_sh = dict.fromkeys(round_sh, NamedSharding(mesh, PartitionSpec()))
    return EngineSpec(
        model_cfg=model_cfg,
        cfg=cfg,
        mesh=mesh,
        cache=cache,
        fuse=fuse,
        pack=pack,
        expected=_expected(model_cfg, mesh, lora),
        dparams_specs=dparams_specs,
        dparams_sh=tree_shardings(dparams_specs, mesh, SAMPLER_RULES),
        state_specs=state_specs,
        state_sh=tree_shardings(state_specs, mesh, SAMPLER_RULES),
        row_sh=row_sh,
        round_sh=round_sh,
        kv_in_sh=shard(layout.PREFIX_AXES, (1, model_cfg.n_kv_heads, cfg.max_prompt_len, model_cfg.head_dim)),
        table_sh=NamedSharding(mesh, PartitionSpec("data", None)),
        replicated=NamedSharding(mesh, PartitionSpec()),
        lora=lora,
    )


# ----- jitted bodies: functions of (spec, arrays) -----


def prefill_body(spec: EngineSpec, dparams, tokens_NxT):
    return decode.prefill_kv(spec.model_cfg, dparams, tokens_NxT, spec.mesh)


def insert_body(spec: EngineSpec, state: DecodeState, keys, values, row_array, *dest) -> DecodeState:
    """Row `src` of the prefix into `slot` (`layout.InsertRow`), its last token the slot's next input."""
    row = layout.InsertRow.from_array(row_array)
    slot = row.slot
    seed, index = jax.lax.bitcast_convert_type(jnp.stack([row.seed, row.sample_index]), jnp.uint32)
    key = sampling.row_keys(seed[None], index[None])[0]
    new_k, new_v = spec.cache.put_prefix(state.k, state.v, keys, values, row.src, slot, *dest)
    return DecodeState(
        k=new_k,
        v=new_v,
        next_token=state.next_token.at[slot].set(row.last_token),
        pos=state.pos.at[slot].set(row.pos),
        last_pos=state.last_pos.at[slot].set(row.last_pos),
        done=state.done.at[slot].set(False),
        key=state.key.at[slot].set(key),
    )


def release_body(spec: EngineSpec, state: DecodeState, mask_B) -> DecodeState:
    return state.replace(done=state.done | mask_B)


def generate_body(spec: EngineSpec, dparams, state: DecodeState, *table):
    """`steps_per_call` decode steps in one `lax.scan` -> (state, outputs [steps, B] and done [B])."""
    c = spec.cfg
    stop = jnp.asarray(c.stop_tokens or (-1,), jnp.int32)

    def one(state: DecodeState, _):
        attention = spec.cache.step_attention(c.attention, state.k, state.pos, state.done, *table)
        logits_BxV, keys, values = decode.decode_step(
            spec.model_cfg, dparams, state.k, state.v, state.next_token, state.pos, layer_attention=attention
        )
        new_pos = state.pos + 1
        tok, logp, slogp = sampling.sample(
            logits_BxV,
            state.key,
            new_pos,
            temperature=c.temperature,
            top_k=c.top_k,
            top_p=c.top_p,
            top_p_candidates=c.top_p_candidates,
        )
        was_done = state.done
        done = was_done | jnp.any(tok[:, None] == stop[None, :], axis=-1) | (new_pos >= state.last_pos)
        state = state.replace(
            k=keys,
            v=values,
            done=done,
            next_token=jnp.where(was_done, state.next_token, tok),
            pos=jnp.where(was_done, state.pos, new_pos),
        )
        return state, (tok, logp, slogp, ~was_done)

    state, (tok, logp, slogp, valid) = jax.lax.scan(one, state, None, length=c.steps_per_call)
    out = {"tokens": tok, "logprobs": logp, "sample_logprobs": slogp, "valid": valid, "done": state.done}
    return state, out


def recompute_body(spec: EngineSpec, dparams, state: DecodeState, tokens_BxT, *dest) -> DecodeState:
    """Every slot's cache rebuilt from its tokens with `dparams` (recompute_kv)."""
    keys, values = decode.prefill_kv(spec.model_cfg, dparams, tokens_BxT, spec.mesh)
    new_k, new_v = spec.cache.write_sequences(state.k, state.v, keys, values, *dest)
    return state.replace(k=new_k, v=new_v)


# Positions of extend's bucket padding are written here: past every cache, so the write is dropped (the
# slotted cache) or lands on the scratch page (the paged one).
_NOWHERE = 1 << 30


def extend_body(spec: EngineSpec, dparams, state: DecodeState, tokens_T, row, view_len: int, *extra):
    """Appends an observation to the sequence parked in a slot, and makes the slot decode again.

    `row` = (slot, m, max_new_tokens): the first m of `tokens_T` are the observation (the rest padding).
    The tokens attend to the slot's first `view_len` positions (static: a length bucket of the context
    and the observation), so the cost grows with the context, not with the slot's capacity.
    The slot's pending token (its last sampled one, whose key/value no decode step wrote yet) and the
    first m - 1 observation tokens get their keys/values at the slot's next positions; the last
    observation token becomes the slot's next input, as a prompt's last token does after `insert`. The
    slot's random key stays: sampling depends on (seed, sample index) and positions only, so the slot
    draws what a fresh prefill of the whole context would.
    """
    slot, m, max_new = row[0], row[1], row[2]
    start = state.pos[slot]
    t = tokens_T.shape[0]
    index_T = jnp.arange(t, dtype=jnp.int32)
    inputs_1xT = jnp.concatenate([state.next_token[slot][None], tokens_T[:-1]])[None]
    positions_T = start + index_T
    cache = spec.cache
    views = [
        (cache.extend_view(k, slot, view_len, *extra), cache.extend_view(v, slot, view_len, *extra))
        for k, v in zip(state.k, state.v, strict=True)
    ]
    new_k, new_v = decode.extend_kv(spec.model_cfg, dparams, views, inputs_1xT, positions_T[None])
    write_T = jnp.where(index_T < m, positions_T, _NOWHERE)
    keys = [cache.extend_write(b, n, slot, write_T, *extra) for b, n in zip(state.k, new_k, strict=True)]
    values = [cache.extend_write(b, n, slot, write_T, *extra) for b, n in zip(state.v, new_v, strict=True)]
    new_pos = start + m
    return state.replace(
        k=keys,
        v=values,
        next_token=state.next_token.at[slot].set(tokens_T[m - 1]),
        pos=state.pos.at[slot].set(new_pos),
        last_pos=state.last_pos.at[slot].set(new_pos + max_new),
        done=state.done.at[slot].set(False),
    )


def timing_state_body(spec: EngineSpec) -> DecodeState:
    """Every slot live at mid-capacity (for timing `generate`; the cache contents do not matter)."""
    state = layout.initialize(spec.state_specs)
    b, mid = spec.cfg.num_slots, spec.capacity // 2
    full = lambda v: jnp.full((b,), v, jnp.int32)
    return state.replace(pos=full(mid), last_pos=full(spec.capacity - 1), done=jnp.zeros((b,), bool))


class EntryPoints(NamedTuple):
    """The jitted entry points of an engine (lowered and compiled per signature by `Engine`)."""

    to_layout: object
    adapters_layout: object
    prefill: object
    insert: object
    generate: object
    recompute: object
    extend: object
    release: object
    init_state: object


def jit_entry_points(spec: EngineSpec) -> EntryPoints:
    """The bodies bound to `spec`, with explicit shardings; the decode state is donated."""
    s = spec
    table_sh = s.cache.extra_shardings(s.table_sh)  # the page table / insert's dest; () for slotted
    bind = lambda body: functools.partial(body, s)
    to_layout = functools.partial(layout.to_decode_layout, s.model_cfg, fuse=s.fuse, pack=s.pack, lora=s.lora)
    adapters_layout = None
    if s.lora is not None:
        names = lora_lib.adapter_specs(s.model_cfg, s.lora)["layers"]
        adapters_sh = [{n: lsh[n] for n in names} for lsh in s.dparams_sh["layers"]]
        adapters_layout = jax.jit(
            functools.partial(layout.adapters_to_decode_layout, s.model_cfg, lora=s.lora),
            out_shardings=adapters_sh,
        )
    recompute_in = (s.dparams_sh, s.state_sh, SAMPLER_RULES.sharding(s.mesh, ("batch", None)), *table_sh)
    extend_sh = tuple(x.sharding for x in s.cache.extend_args(s.replicated))
    return EntryPoints(
        to_layout=jax.jit(to_layout, out_shardings=s.dparams_sh),
        adapters_layout=adapters_layout,
        prefill=jax.jit(
            bind(prefill_body), in_shardings=(s.dparams_sh, s.replicated), out_shardings=(s.kv_in_sh,) * 2
        ),
        insert=jax.jit(
            bind(insert_body),
            donate_argnums=0,
            in_shardings=(s.state_sh, s.kv_in_sh, s.kv_in_sh, s.replicated, *table_sh),
            out_shardings=s.state_sh,
        ),
        generate=jax.jit(
            bind(generate_body),
            donate_argnums=1,
            in_shardings=(s.dparams_sh, s.state_sh, *table_sh),
            out_shardings=(s.state_sh, s.round_sh),
        ),
        recompute=jax.jit(
            bind(recompute_body), donate_argnums=1, in_shardings=recompute_in, out_shardings=s.state_sh
        ),
        extend=jax.jit(
            bind(extend_body),
            static_argnums=4,
            donate_argnums=1,
            in_shardings=(s.dparams_sh, s.state_sh, s.replicated, s.replicated, *extend_sh),
            out_shardings=s.state_sh,
        ),
        release=jax.jit(
            bind(release_body),
            donate_argnums=0,
            in_shardings=(s.state_sh, s.row_sh),
            out_shardings=s.state_sh,
        ),
        init_state=jax.jit(functools.partial(layout.initialize, s.state_specs), out_shardings=s.state_sh),
    )
