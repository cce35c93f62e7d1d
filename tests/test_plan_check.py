"""Plan check: the train step compiles for a trainer mesh on abstract arrays and reports memory."""

import dataclasses

import jax

from jaxrl_async.model import presets
from jaxrl_async.perf.plan_check import kv_cache_bytes, plan_check, sampler_weight_bytes, train_memory
from jaxrl_async.sampler import SamplerConfig
from jaxrl_async.trainer import TrainConfig

CFG = presets.tiny(vocab_size=256, n_layers=2)


def test_train_memory_grows_with_the_micro_batch_and_shrinks_with_sharding():
    small = train_memory(TrainConfig(token_budget=64, rows_per_micro=4), CFG, (2, 1), jax.devices()[:2])
    big = train_memory(TrainConfig(token_budget=256, rows_per_micro=4), CFG, (2, 1), jax.devices()[:2])
    assert small["argument_size"] > 0 and big["temp_size"] > small["temp_size"]
    one = train_memory(TrainConfig(token_budget=64, rows_per_micro=4), CFG, (1, 1), jax.devices()[:1])
    four = train_memory(TrainConfig(token_budget=64, rows_per_micro=4), CFG, (4, 1), jax.devices()[:4])
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

    report = plan_check(CFG, TrainConfig(token_budget=64, rows_per_micro=2), s, Mesh())
    assert report["trainer"]["peak_estimate"] > 0 and report["sampler"]["total"] > 0
