"""A greedy eval engine that shares the sampler engine's weights: one weight copy on the sampler devices."""

import dataclasses
import gc

import jax
import numpy as np
import pytest

from jaxrl_async.model import init_params, presets
from jaxrl_async.runtime.evaluation import eval_sampler_config
from jaxrl_async.sampler import Engine, Request, SamplerConfig, SamplerLoop
from jaxrl_async.sharding import SAMPLER_RULES, make_mesh

TINY = presets.tiny(vocab_size=64, n_layers=2, max_seq_len=64)
MESH = make_mesh((2, 1), ("data", "tensor"), jax.devices()[6:8])
CFG = SamplerConfig(num_slots=4, max_prompt_len=16, max_new_tokens=8, steps_per_call=4, temperature=1.0)


def _params(seed):
    params = init_params(TINY, jax.random.key(seed), MESH, SAMPLER_RULES)
    return jax.tree.map(lambda x: x * 1.5 if x.ndim >= 2 else x, params)


def _live_bytes() -> int:
    """Bytes of live device buffers on the sampler mesh's devices (each buffer once: a shard's `.data` is
    another array over the same buffer)."""
    gc.collect()
    devices = set(MESH.devices.flat)
    buffers = {
        (s.device.id, s.data.unsafe_buffer_pointer()): s.data.nbytes
        for a in jax.live_arrays()
        for s in a.addressable_shards
        if s.device in devices
    }
    return sum(buffers.values())


def _greedy(engine, prompts):
    loop = SamplerLoop(engine)
    it = iter([Request(uid=i, prompt_tokens=tuple(p)) for i, p in enumerate(prompts)])
    return {c.uid: [int(t) for t in c.tokens] for c in loop.run(lambda: next(it, None))}


def test_eval_engine_uses_the_sampler_weights_without_a_copy():
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    main = Engine(TINY, _params(0), MESH, CFG)
    before = _live_bytes()
    evals = Engine(TINY, None, MESH, eval_sampler_config(CFG, 2, 2), weights_from=main)
    assert _live_bytes() == before  # no weights of its own
    assert evals.cfg.greedy and evals.cfg.num_slots == 2 and evals.cfg.slot_len == CFG.slot_len

    # An update through the sampler's engine is what the eval engine decodes with ...
    new = _params(1)
    main.update_params(new, 3)
    assert evals.version == 3
    shared = _greedy(evals, prompts)
    # On each of the 2 devices: the decode layout once, plus the incoming copy `new` still referenced here.
    assert _live_bytes() == 2 * 2 * main.weight_bytes_per_device()
    own = Engine(TINY, new, MESH, eval_sampler_config(CFG, 2, 2))
    assert shared == _greedy(own, prompts)
    del own

    # ... and an update replaces the shared layout: nothing accumulates on the devices.
    settled = _live_bytes()
    main.update_params(_params(2), 4)
    assert _live_bytes() == settled


def test_weights_from_rejects_another_layout():
    main = Engine(TINY, _params(0), MESH, CFG)
    with pytest.raises(ValueError, match="weights_from"):
        Engine(TINY, None, MESH, dataclasses.replace(CFG, fuse_projections=False), weights_from=main)
    with pytest.raises(ValueError, match="weights_from"):
        Engine(TINY.replace(n_layers=1), None, MESH, CFG, weights_from=main)
    with pytest.raises(ValueError, match="weights_from"):
        Engine(TINY, _params(1), MESH, CFG, weights_from=main)


def test_evaluation_accuracy_weighs_each_prompt_by_its_weight():
    from jaxrl_async.data.prompt import Prompt
    from jaxrl_async.runtime.evaluation import Evaluation

    def prompt(uid, tokens, weight):
        return Prompt(uid, "", np.asarray(tokens, np.int32), "", {}, weight=weight)

    prompts = [prompt("a", [1, 2, 3], 0.7), prompt("b", [4, 5], 0.2), prompt("c", [6, 7, 8, 9], 0.1)]
    ev = Evaluation(Engine(TINY, _params(0), MESH, eval_sampler_config(CFG, 2, 2)), None, None, prompts,
                    None, 5)  # fmt: skip
    done = []
    while not ev.loop.idle:
        done += ev.decode()
    assert sorted(c.uid for c in done) == ["a", "b", "c"]
    for uid, reward in (("a", 1.0), ("b", 0.0), ("c", 1.0)):  # two of three right, most of the weight
        assert ev.owns(("eval", 5, uid))
        ev.take(("eval", 5, uid), reward)
    assert ev.done and ev.correct == 2
    assert ev.accuracy == pytest.approx(0.8)  # 0.7 + 0.1, not 2/3


def test_accuracy_by_answer_length_bands_the_weighted_accuracy():
    from jaxrl_async.data.prompt import Prompt
    from jaxrl_async.runtime.evaluation import accuracy_by_length, weighted_accuracy
    from jaxrl_async.tokenizer import CharTokenizer

    def graded(answer, weight, reward):
        return Prompt(answer, "", np.zeros(1, np.int32), answer, {}, weight=weight), reward

    rows = [graded("a", 0.4, 0.0), graded("b", 0.1, 1.0), graded("abc", 0.2, 1.0), graded("abcd", 0.1, 0.0),
            graded("abcdefghij", 0.2, 1.0)]  # fmt: skip
    bands = accuracy_by_length(rows, CharTokenizer())
    assert list(bands) == ["1", "2-3", "4-7", "8-15"]
    assert bands["1"] == pytest.approx({"accuracy": 0.2, "weight": 0.4 + 0.1, "prompts": 2})
    assert bands["2-3"]["accuracy"] == 1.0 and bands["4-7"]["accuracy"] == 0.0
    # The bands add up to the whole: their weight shares sum to 1 and weigh back to the overall accuracy.
    assert sum(b["weight"] for b in bands.values()) == pytest.approx(1.0)
    whole = sum(b["weight"] * b["accuracy"] for b in bands.values())
    assert whole == pytest.approx(weighted_accuracy(rows)) and weighted_accuracy(rows) == pytest.approx(0.5)
    assert weighted_accuracy([]) == 0.0 and accuracy_by_length([], CharTokenizer()) == {}
