"""Plan check: the train step compiles for a trainer mesh on abstract arrays and reports memory."""

import dataclasses

import jax

from jaxrl_async.model import presets
from jaxrl_async.runtime.plan_check import (
    decode_memory,
    kv_cache_bytes,
    plan_check,
    sampler_weight_bytes,
    target_platform,
    train_memory,
    trainer_attention,
)
from jaxrl_async.sampler import SamplerConfig
from jaxrl_async.trainer import TrainConfig

CFG = presets.tiny(vocab_size=256, n_layers=2)


def test_train_memory_grows_with_the_micro_batch_and_shrinks_with_sharding():
    small = train_memory(
        TrainConfig(token_budget=64, rows_per_micro=4, minibatches=1), CFG, (2, 1), jax.devices()[:2]
    )
    big = train_memory(
        TrainConfig(token_budget=256, rows_per_micro=4, minibatches=1), CFG, (2, 1), jax.devices()[:2]
    )
    assert small["argument_size"] > 0 and big["temp_size"] > small["temp_size"]
    one = train_memory(
        TrainConfig(token_budget=64, rows_per_micro=4, minibatches=1), CFG, (1, 1), jax.devices()[:1]
    )
    four = train_memory(
        TrainConfig(token_budget=64, rows_per_micro=4, minibatches=1), CFG, (4, 1), jax.devices()[:4]
    )
    assert four["argument_size"] < one["argument_size"]  # fsdp shards params and optimizer state


def test_sampler_bytes_and_full_report():
    s = SamplerConfig(num_slots=8, max_prompt_len=16, max_new_tokens=16)
    per_slot = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * s.slot_len * 4
    assert kv_cache_bytes(CFG, 8, s.slot_len, (2, 1), 4) == 4 * per_slot
    assert kv_cache_bytes(CFG, 8, s.slot_len, (2, 2), 4) == 2 * per_slot  # 2 KV heads split over tensor=2
    assert sampler_weight_bytes(CFG, (1, 2), 4) < sampler_weight_bytes(CFG, (2, 1), 4)

    @dataclasses.dataclass
    class Mesh:
        sampler: tuple = (2, 1)
        trainer: tuple = (2, 1)

    mixed = CFG.replace(dtype="bfloat16", param_dtype="float32")
    report = plan_check(mixed, TrainConfig(token_budget=64, rows_per_micro=2), s, Mesh())
    assert report["trainer"]["peak_estimate"] > 0
    assert report["trainer"]["dtypes"] == {"params": ["float32"], "optimizer_state": ["float32"]}
    sampler = report["sampler"]
    assert sampler["dtypes"] == ["bfloat16"]
    # Every buffer a sampler device holds: the weights once, the sampler's and the eval engine's KV caches
    # (plus a few bytes of per-slot scalars each), as counted analytically.
    an = sampler["analytic"]
    assert sampler["weights"] == an["weights"]
    slots = s.num_slots + sampler["eval_slots"]
    assert an["total"] <= sampler["held"] <= an["total"] + slots * 64
    gen, ev = sampler["generate"], sampler["eval_generate"]
    assert sampler["held"] == gen["argument_size"] + ev["argument_size"] - sampler["weights"]
    assert sampler["peak"] >= sampler["held"] + sampler["weights"]  # a weight update holds one more copy


def test_memory_efficient_attention_shows_in_the_compiled_train_step():
    long = TrainConfig(token_budget=1024, rows_per_micro=2, minibatches=1)
    ref = train_memory(long, CFG.replace(attention="reference"), (2, 1), jax.devices()[:2])
    splash = train_memory(long, CFG.replace(attention="splash"), (2, 1), jax.devices()[:2])
    # Reference: float32 scores [heads, T, T] per row (4 MiB a head here); splash keeps O(T) buffers.
    assert splash["temp_size"] < ref["temp_size"] - CFG.n_heads * 1024 * 1024 * 4
    assert (ref["attention"]["compiled_as"], splash["attention"]["compiled_as"]) == ("reference", "splash")


def test_the_target_platform_decides_the_attention_compiled():
    bf16 = TrainConfig(token_budget=4096, compute_dtype="bfloat16")
    gpu = trainer_attention(bf16, CFG, "gpu")
    assert (gpu["target"], gpu["compiled_as"]) == ("cudnn", "splash")
    assert gpu["mask_bytes_per_row"] == 5 * 4096**2  # bool mask + bf16 bias + bf16 bias gradient
    assert trainer_attention(bf16, CFG, "tpu")["target"] == "splash"
    assert trainer_attention(bf16, CFG, "cpu")["compiled_as"] == "reference"
    assert trainer_attention(TrainConfig(token_budget=64), CFG, "gpu")["compiled_as"] == "dot_product"
    assert trainer_attention(bf16, CFG.replace(attention="reference"), "gpu")["compiled_as"] == "reference"
    assert [target_platform(n) for n in ("h100", "tpu-v5p", "cpu")] == ["gpu", "tpu", "cpu"]


def test_decode_memory_is_compiled_and_tracks_the_kv_cache():
    small = decode_memory(
        CFG, SamplerConfig(num_slots=4, max_prompt_len=16, max_new_tokens=16), (1, 1), jax.devices()[:1]
    )
    big = decode_memory(
        CFG, SamplerConfig(num_slots=16, max_prompt_len=16, max_new_tokens=16), (1, 1), jax.devices()[:1]
    )
    per_slot = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 32 * 4
    # 12 more slots: the argument bytes grow by exactly their KV cache (plus a few per-slot scalars).
    assert 12 * per_slot <= big["argument_size"] - small["argument_size"] <= 12 * per_slot + 12 * 64
    split = decode_memory(
        CFG, SamplerConfig(num_slots=16, max_prompt_len=16, max_new_tokens=16), (2, 1), jax.devices()[:2]
    )
    assert split["argument_size"] < big["argument_size"]  # slots split over the data axis


def test_decode_memory_of_a_bf16_model_drops_the_cpu_upcast_copies():
    bf16 = dataclasses.replace(CFG, dtype="bfloat16", param_dtype="bfloat16")
    s = SamplerConfig(num_slots=8, max_prompt_len=16, max_new_tokens=16)
    m = decode_memory(bf16, s, (1, 1), jax.devices()[:1])
    f32 = decode_memory(CFG, s, (1, 1), jax.devices()[:1])
    assert m["argument_size"] < f32["argument_size"]  # bf16 weights and KV cache
    assert m["temp_size_accelerator"] == f32["temp_size"]  # temporaries taken from the f32 twin
    assert f32["temp_size_accelerator"] == f32["temp_size"]
    assert m["peak_accelerator"] >= m["argument_size"]
