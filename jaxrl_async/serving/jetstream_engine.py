"""The sampler engine behind JetStream's engine API (`jetstream.engine.engine_api.Engine`, google-jetstream
0.2.2), and our tokenizers behind JetStream's tokenizer API.

JetStream's contract, and how it maps onto `jaxrl_async.sampler.Engine`:
  - `load_params()` -> params: the engine owns its weights on device (in the decode layout), so JetStream's
    params are a `LoadedWeights` handle naming the weight version; `load_params(params, version)` swaps in
    new weights (sampler layout, validated) and returns the new handle.
  - `prefill(params=, padded_tokens=, true_length=)` -> our `Prefix` (the prompt's keys/values). JetStream
    0.2.2's prefill returns no token: our `generate` samples every token, the first included.
  - `insert(prefix, decode_state, slot)` -> decode state: the slot generates up to the engine's
    SamplerConfig.max_new_tokens; JetStream ends a request earlier, at its `max_tokens`, by the lengths
    `generate` reports.
  - `generate(params, decode_state)` -> (decode state, `ResultTokens` [slots, 3]: the token, whether the slot
    was live when it was produced, and the number of tokens the slot has generated).

Decode state: {"engine": the sampler engine's state, "lengths": int32 [num_slots]}. One decode step per
`generate` call (SamplerConfig.steps_per_call=1): JetStream's detokenizer compares the lengths with a
request's `max_tokens` once per call, so several steps per call would overshoot `max_tokens`. The engine
needs the slotted KV cache (attention "xla" or "cpu_kernel"): the paged cache's page tables are host state
that JetStream's stateless insert/generate calls cannot carry.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

from jaxrl_async.sampler import Engine, Prefix
from jaxrl_async.sampler.layout import CACHE_AXES
from jaxrl_async.serving.load import encode_prompt
from jaxrl_async.sharding import SAMPLER_RULES
from jaxrl_async.tokenizer import Tokenizer, load_tokenizer


@dataclasses.dataclass(frozen=True)
class LoadedWeights:
    """JetStream's `params` for this engine: which weights the engine holds (they stay inside it)."""

    version: int  # policy version of the weights


class JetStreamTokenizer(tokenizer_api.Tokenizer):
    """One of our tokenizers (Hugging Face or "char") behind JetStream's tokenizer API.

    Text prompts get the generate CLI's tokens (`encode_prompt`: BOS rule included), so the server and
    `jaxrl-generate` see the same prompt. Streaming decode is one token at a time, as JetStream asks.
    """

    def __init__(self, tok: Tokenizer, prompt_buckets: tuple[int, ...], stop_ids: tuple[int, ...]):
        """
        Args:
          prompt_buckets: the engine's prompt lengths (padding targets); the last is the longest prompt.
          stop_ids: the engine's stop tokens (JetStream ends a sample at any of them, not emitting it).
        """
        self._tok = tok
        self._buckets = list(prompt_buckets)
        self._stop_ids = set(stop_ids)

    def encode(self, s: str, **kwargs) -> tuple[np.ndarray, int]:
        """(tokens padded to a prompt bucket, true length).

        kwargs (JetStream's): is_bos (default True; False for a continued session: no BOS added),
        jax_padding (a jax array instead of numpy); prefill_lengths and max_prefill_length are the
        engine's own buckets here, so they are ignored.

        Raises:
          ValueError: the prompt is longer than the longest bucket (JetStream would silently keep its end).
        """
        tokens = encode_prompt(self._tok, s) if kwargs.get("is_bos", True) else self._tok.encode(s)
        if len(tokens) > self._buckets[-1]:
            raise ValueError(
                f"prompt of {len(tokens)} tokens exceeds the server's max prompt length {self._buckets[-1]}"
            )
        padded, true_length = token_utils.pad_tokens(
            np.asarray(tokens, np.int32),
            self.bos_id,
            self.pad_id,
            is_bos=False,
            prefill_lengths=self._buckets,
            jax_padding=kwargs.get("jax_padding", True),
        )
        return padded, true_length

    def decode(self, token_ids: list[int], **kwargs) -> str:
        return self._tok.decode([int(t) for t in token_ids])

    @property
    def stop_tokens(self) -> set[int]:
        return set(self._stop_ids)

    @property
    def pad_id(self) -> int:
        return self._tok.pad_id

    @property
    def eos_id(self) -> int:
        return self._tok.eos_id

    @property
    def bos_id(self) -> int | None:
        """None when the tokenizer has no BOS token."""
        return self._tok.bos_id


class JetStreamEngine(engine_api.Engine):
    """`jaxrl_async.sampler.Engine` (slotted cache, one step per call) as a JetStream engine."""

    def __init__(self, engine: Engine, tokenizer: str, seed: int = 0):
        """
        Args:
          engine: the sampler engine, holding the weights; its SamplerConfig sets the slots, the prompt
            buckets, the sampling method and the stop tokens.
          tokenizer: a Hugging Face tokenizer directory or "char" (what `get_tokenizer` hands to
            `build_tokenizer`).
          seed: the sampling seed; each inserted request draws from its own stream (seed, request index).

        Raises:
          ValueError: the engine has a paged cache or decodes more than one step per call.
        """
        if engine.paged:
            raise ValueError(
                "JetStreamEngine: the engine has a paged cache (attention='paged_kernel'), whose page tables "
                "JetStream's insert/generate cannot carry; use attention='xla' or 'cpu_kernel'"
            )
        if engine.cfg.steps_per_call != 1:
            raise ValueError(
                f"JetStreamEngine: SamplerConfig.steps_per_call={engine.cfg.steps_per_call}; JetStream "
                "checks max_tokens once per generate call, so it must be 1"
            )
        self._engine = engine
        self._tokenizer = tokenizer
        self._seed = int(seed)
        self._request_index = itertools.count()
        replicated = NamedSharding(engine.mesh, PartitionSpec())
        self._zeros = jax.jit(
            functools.partial(jnp.zeros, (engine.cfg.num_slots,), jnp.int32), out_shardings=replicated
        )
        self._reset_length = jax.jit(_reset_length, donate_argnums=0, out_shardings=replicated)
        self._pack = jax.jit(_pack, donate_argnums=2, out_shardings=(replicated, replicated))

    # ----- weights -----

    def load_params(self, params: dict | None = None, version: int | None = None) -> LoadedWeights:
        """The handle of the engine's weights; with `params` (sampler layout on the engine's mesh) these
        replace them first, as `version` (default: the current version + 1). Slots already decoding keep
        their keys/values."""
        if params is not None:
            self._engine.update_params(params, self._engine.version + 1 if version is None else version)
        return LoadedWeights(self._engine.version)

    def _check(self, params: LoadedWeights) -> None:
        if not isinstance(params, LoadedWeights) or params.version != self._engine.version:
            raise ValueError(
                f"params {params!r} are not this engine's weights (version {self._engine.version}); "
                "pass what load_params returned"
            )

    # ----- prefill / insert / generate -----

    def prefill(
        self,
        *,
        params: LoadedWeights,
        existing_prefix: Prefix | None = None,
        padded_tokens,
        true_length: int,
    ) -> Prefix:
        """The keys/values of padded_tokens[:true_length].

        Raises:
          NotImplementedError: `existing_prefix` (continuing a cached prefix) is not supported.
          ValueError: `params` are stale, or the prompt is empty or longer than max_prefill_length.
        """
        if existing_prefix is not None:
            raise NotImplementedError("JetStreamEngine.prefill: existing_prefix is not supported")
        self._check(params)
        tokens = np.asarray(padded_tokens)
        if tokens.ndim != 1 or not 0 < true_length <= tokens.shape[0]:
            raise ValueError(
                f"prefill: padded_tokens must be 1-D with 0 < true_length <= its length, got shape "
                f"{tokens.shape} and true_length={true_length}"
            )
        return self._engine.prefill(tokens[:true_length])

    def insert(self, prefix: Prefix, decode_state: dict, slot: int) -> dict:
        """Places `prefix` in `slot` (donating `decode_state`); the slot generates until a stop token or
        SamplerConfig.max_new_tokens."""
        state = self._engine.insert(
            decode_state["engine"],
            prefix,
            slot,
            seed=self._seed,
            sample_index=next(self._request_index),
            max_new_tokens=self._engine.cfg.max_new_tokens,
        )
        return {"engine": state, "lengths": self._reset_length(decode_state["lengths"], slot)}

    def generate(self, params: LoadedWeights, decode_state: dict) -> tuple[dict, engine_api.ResultTokens]:
        """One decode step for every slot (donating `decode_state`)."""
        self._check(params)
        state, rnd = self._engine.generate(decode_state["engine"])
        data_Bx3, lengths_B = self._pack(rnd.tokens, rnd.valid, decode_state["lengths"])
        result = engine_api.ResultTokens(
            data=data_Bx3, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1
        )
        return {"engine": state, "lengths": lengths_B}, result

    def init_decode_state(self) -> dict:
        """Every slot free."""
        return {"engine": self._engine.init_state(), "lengths": self._zeros()}

    # ----- description -----

    def get_prefix_destination_sharding(self) -> NamedSharding:
        """Where a prefix's keys/values live: per layer [1, kv_heads, bucket, head_dim], replicated over
        "data" (any slot takes any prefix)."""
        m = self._engine.model_cfg
        shape = (1, m.n_kv_heads, self._engine.cfg.max_prompt_len, m.head_dim)
        return SAMPLER_RULES.sharding(self._engine.mesh, (None, *CACHE_AXES[1:]), shape)

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path=self._tokenizer)

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> JetStreamTokenizer:
        cfg = self._engine.cfg
        return JetStreamTokenizer(load_tokenizer(metadata.path), cfg.prompt_buckets, cfg.stop_tokens)

    @property
    def max_concurrent_decodes(self) -> int:
        return self._engine.cfg.num_slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._engine.cfg.max_prompt_len

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self._engine.mesh

    @property
    def colocated_cpus(self) -> None:
        """None: the engine uses no colocated CPU devices."""
        return None


def _reset_length(lengths_B, slot):
    return lengths_B.at[slot].set(0)


def _pack(tokens_1xB, valid_1xB, lengths_B):
    """ResultTokens data [B, 3] (token, valid, generated count) and the new counts."""
    lengths_B = lengths_B + valid_1xB[0].astype(jnp.int32)
    data_Bx3 = jnp.stack([tokens_1xB[0], valid_1xB[0].astype(jnp.int32), lengths_B], axis=1)
    return data_Bx3.astype(jnp.int32), lengths_B
