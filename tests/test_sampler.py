"""Sampler engine and loop: cached decode == full forward, logprob parity, slot independence, weight updates,
no recompilation inside a bucket, sharded == single device, and the generate CLI."""

import functools
import os
import shutil
import sys

import host_caps
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.model import forward_logits, init_params, presets, save_hf, token_logprobs
from jaxrl_async.sampler import (
    Engine,
    Request,
    SamplerConfig,
    SamplerLoop,
    cpu_kernels,
    decode,
    layout,
    sampling,
)
from jaxrl_async.sharding import SAMPLER_RULES, make_mesh
from tests.procs import started

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# GQA + qkv bias + QK-norm exercise every branch of the decode layout; vocab 64 shards over tensor=2.
TINY = presets.tiny(vocab_size=64, n_layers=2, max_seq_len=64, qkv_bias=True, qk_norm=True)
MESH1 = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])

_COMPILES = [0]


def _count_compiles(event, *_args, **_kw):
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def _params(seed=0, mesh=MESH1, cfg=TINY):
    params = init_params(cfg, jax.random.key(seed), mesh, SAMPLER_RULES)
    # Random init keeps logits near-uniform; sharpen them so greedy/argmax comparisons are meaningful.
    return jax.tree.map(lambda x: x * 1.5 if x.ndim >= 2 else x, params)


def _loop(params, mesh=MESH1, cfg=TINY, **kw):
    base = dict(num_slots=4, max_prompt_len=16, max_new_tokens=12, steps_per_call=4, temperature=0.0)
    base.update(kw)
    return SamplerLoop(Engine(cfg, params, mesh, SamplerConfig(**base)))


def _prompts(n, seed=0, lo=2, hi=16):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY.vocab_size, size=rng.integers(lo, hi + 1)).tolist() for _ in range(n)]


def _by_uid(completions):
    return {(c.uid, c.sample_index): c for c in completions}


def _full_logits(params, seq, cfg=TINY):
    """Trainer-side logits [len(seq), V] by a full forward (padded to 48 so it compiles once; causal)."""
    padded = np.zeros((1, 48), np.int32)
    padded[0, : len(seq)] = seq
    return forward_logits(cfg, params, padded)[0, : len(seq)]


def _greedy_reference(params, prompt, n, cfg=TINY, stop=None):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.asarray(_full_logits(params, seq, cfg))[-1].argmax()))
        if seq[-1] == stop:
            break
    return seq[len(prompt) :]


def _trainer_logprobs(params, prompt, tokens, temperature, cfg=TINY):
    logits = _full_logits(params, list(prompt) + list(tokens), cfg)[len(prompt) - 1 : -1]
    targets = jnp.asarray(np.asarray(tokens, np.int32))
    return np.asarray(token_logprobs(logits[None], targets[None], temperature)[0])[0]


@pytest.fixture(scope="module")
def params():
    return _params()


def _perturb_norms(params, seed=0):
    """Norm weights away from their all-ones init, so a norm applied wrongly (or not at all) shows."""
    rng = np.random.default_rng(seed)
    layers = {
        k: v * (1 + 0.3 * rng.standard_normal(v.shape)).astype(np.float32) if "norm" in k else v
        for k, v in params["layers"].items()
    }
    return dict(params, layers=layers)


# The model-family flag QK-norm over all heads (`ModelConfig.qk_norm_all_heads`), with perturbed norms.
ALL_HEADS = TINY.replace(qk_norm_all_heads=True)


@pytest.mark.parametrize(
    "fuse,tied,all_heads", [(True, False, False), (False, True, False), (True, False, True)]
)
def test_greedy_cached_decode_equals_full_forward(params, fuse, tied, all_heads):
    cfg = TINY.replace(tie_embeddings=tied, qk_norm_all_heads=all_heads)
    if tied:  # unit-variance embeddings used as the unembedding give logits ~20: scale to a realistic range
        params = _params(cfg=cfg)
        params["embed"] = params["embed"] * 0.25
    if all_heads:
        params = _perturb_norms(_params(cfg=cfg))
    loop = _loop(params, cfg=cfg, fuse_projections=fuse)
    prompts = _prompts(6, seed=1)
    for i, p in enumerate(prompts):
        loop.add_request(Request(i, p, max_new_tokens=4 + i))
    out = _by_uid(loop.run())
    assert len(out) == 6
    for i, p in enumerate(prompts):
        c = out[(i, 0)]
        ref = _greedy_reference(params, p, 4 + i, cfg)  # repeated full forward, no cache
        assert c.tokens.tolist() == ref and c.finish_reason == "length"
        np.testing.assert_allclose(c.logprobs, _trainer_logprobs(params, p, ref, 1.0, cfg), atol=1e-5, rtol=0)


def test_sampled_logprobs_match_trainer_and_truncation(params):
    temp, top_k = 0.7, 5
    loop = _loop(params, temperature=temp, top_k=top_k, top_p=0.9)
    prompts = _prompts(4, seed=2)
    for i, p in enumerate(prompts):
        loop.add_request(Request(i, p, n_samples=2, seed=i))
    out = _by_uid(loop.run())
    for (i, _), c in out.items():
        p = prompts[i]
        np.testing.assert_allclose(
            c.logprobs, _trainer_logprobs(params, p, c.tokens, temp), atol=1e-5, rtol=0
        )
        assert np.all(c.sample_logprobs >= c.logprobs - 1e-6) and np.all(c.sample_logprobs <= 1e-6)
        logits = np.asarray(_full_logits(params, list(p) + c.tokens.tolist()))
        kth = np.sort(logits[len(p) - 1 : -1], axis=-1)[:, -top_k]
        chosen = logits[np.arange(len(p) - 1, len(p) - 1 + len(c.tokens)), c.tokens]
        assert np.all(chosen >= kth)  # every token came from the top-k set


@pytest.mark.parametrize("kernels", [("xla", "xla"), ("cpu_kernel", "cpu_kernel")])
def test_qk_norm_all_heads_sampled_logprobs_match_the_trainer(kernels):
    if "cpu_kernel" in kernels:
        _need_cxx()
    params = _perturb_norms(_params(cfg=ALL_HEADS), seed=1)
    attention, linear = kernels
    loop = _loop(params, cfg=ALL_HEADS, temperature=0.8, attention=attention, linear=linear)
    prompts = _prompts(3, seed=12)
    for i, p in enumerate(prompts):
        loop.add_request(Request(i, p, n_samples=2, seed=i, max_new_tokens=6))
    out = loop.run()
    assert len(out) == 6
    for c in out:
        want = _trainer_logprobs(params, prompts[c.uid], c.tokens, 0.8, ALL_HEADS)
        np.testing.assert_allclose(c.logprobs, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "attention,fuse,pack", [("xla", True, False), ("xla", False, False), ("cpu_kernel", False, True)]
)
def test_decode_step_with_ragged_rows_equals_full_forward(params, attention, fuse, pack):
    """The decode path below the engine: prefill, then steps at a different position in each row."""
    if attention == "cpu_kernel":
        _need_cxx()
    params = jax.device_get(params)  # the CPU kernels run on one unsharded device
    tokens = np.random.default_rng(5).integers(0, TINY.vocab_size, (2, 10)).astype(np.int32)
    full = np.asarray(forward_logits(TINY, params, tokens))
    dparams = layout.to_decode_layout(TINY, params, fuse, pack)
    # Row 0 prefills its 6 first tokens, row 1 only 4: its positions 4 and 5 hold another sequence's keys
    # and values until the decode steps write them.
    prompt = tokens[:, :6].copy()
    prompt[1, 4:] = (prompt[1, 4:] + 1) % TINY.vocab_size
    keys, values = decode.prefill_kv(TINY, dparams, jnp.asarray(prompt))
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 10), (0, 0)))  # a cache of 16 positions
    keys, values = [pad(k) for k in keys], [pad(v) for v in values]
    step = jax.jit(functools.partial(decode.decode_step, TINY, attention=attention))
    lens = np.array([6, 4], np.int32)
    for _ in range(4):
        logits, keys, values = step(dparams, keys, values, tokens[np.arange(2), lens], lens)
        for r in range(2):
            np.testing.assert_allclose(np.asarray(logits[r]), full[r, lens[r]], atol=1e-5)
        lens = lens + 1


def test_output_independent_of_slot_and_batch(params):
    target = Request("t", _prompts(1, seed=3)[0], n_samples=2, seed=7, max_new_tokens=10)
    alone = _loop(params, temperature=1.0)
    alone.add_request(target)
    ref = _by_uid(alone.run())
    busy = _loop(params, temperature=1.0, steps_per_call=3)
    for i, p in enumerate(_prompts(5, seed=4)):  # the target lands in other slots, mid-stream
        busy.add_request(Request(i, p, seed=100 + i, max_new_tokens=3 + 2 * i))
    busy.add_request(target)
    got = _by_uid(busy.run())
    for s in range(2):
        assert got[("t", s)].tokens.tolist() == ref[("t", s)].tokens.tolist()
        np.testing.assert_allclose(got[("t", s)].logprobs, ref[("t", s)].logprobs, atol=1e-6)
    assert ref[("t", 0)].tokens.tolist() != ref[("t", 1)].tokens.tolist()  # group samples differ
    assert alone.stats.prefills == 1  # a group shares one prefill


def test_recompute_kv_equals_fresh_generation_under_new_weights(params):
    new = _params(seed=1)
    prompt = _prompts(1, seed=5)[0]
    loop = _loop(params, temperature=1.0, steps_per_call=2, overlap_host=False)
    loop.add_request(Request("a", prompt, seed=3))
    loop.step(), loop.step()
    loop.update_params(new, version=1, mode="recompute_kv")
    a = _by_uid(loop.run())[("a", 0)]
    n_old = int(np.sum(a.versions == 0))
    assert n_old == 4 and a.versions.tolist() == [0] * n_old + [1] * (12 - n_old)
    fresh = _loop(new, temperature=1.0)
    fresh.add_request(Request("b", prompt + a.tokens[:n_old].tolist(), seed=3, max_new_tokens=12 - n_old))
    b = _by_uid(fresh.run())[("b", 0)]
    assert b.tokens.tolist() == a.tokens[n_old:].tolist()
    np.testing.assert_allclose(b.logprobs, a.logprobs[n_old:], atol=1e-5)


def test_keep_kv_and_finish_version_stamps(params):
    new = _params(seed=1)
    loop = _loop(params, steps_per_call=2)  # overlap_host: a round in flight keeps its old version
    prompts = _prompts(6, seed=6)
    for i, p in enumerate(prompts[:2]):
        loop.add_request(Request(i, p))
    loop.step(), loop.step()
    loop.update_params(new, version=5, mode="keep_kv")
    kept = _by_uid(loop.run())
    for c in kept.values():
        assert c.versions.tolist() == [0] * 4 + [5] * 8  # 2 calls were dispatched before the swap

    loop.update_params(params, version=6, mode="keep_kv")
    for i, p in enumerate(prompts[2:4]):
        loop.add_request(Request(10 + i, p, max_new_tokens=6))
    loop.step()
    loop.update_params(new, version=7, mode="finish")
    assert not loop.can_admit()
    for i, p in enumerate(prompts[4:]):
        loop.add_request(Request(20 + i, p, max_new_tokens=6))
    done = _by_uid(loop.run())
    for uid in (10, 11):
        assert set(done[(uid, 0)].versions.tolist()) == {6}
    for uid in (20, 21):
        assert set(done[(uid, 0)].versions.tolist()) == {7}
    assert loop.engine.version == 7


def test_update_params_validation_names_the_leaf(params):
    loop = _loop(params)
    bad_shape = jax.tree.map(lambda x: x, params)
    bad_shape["layers"]["up"] = jnp.zeros((2, 128, 100))
    with pytest.raises(ValueError, match=r"\['layers'\]\['up'\].*shape"):
        loop.update_params(bad_shape, 1)
    bad_dtype = dict(params, final_norm=params["final_norm"].astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"\['final_norm'\].*dtype"):
        loop.update_params(bad_dtype, 1)
    with pytest.raises(ValueError, match=r"missing leaves \[\"\['lm_head'\]\"\]"):
        loop.update_params({k: v for k, v in params.items() if k != "lm_head"}, 1, mode="finish")
    other = make_mesh((1, 1), ("data", "tensor"), jax.devices()[1:2])
    moved = dict(params, embed=jax.device_put(params["embed"], jax.sharding.NamedSharding(other, jax.P())))
    with pytest.raises(ValueError, match=r"\['embed'\].*sharding"):
        loop.update_params(moved, 1)
    assert loop.engine.version == 0


def test_requests_that_cannot_fit_and_bad_configs(params):
    loop = _loop(params, token_budget=4 * 20)  # 20 positions per slot
    with pytest.raises(
        ValueError, match=r"Request 'long' cannot fit: prompt of 17 tokens exceeds max_prompt_len"
    ):
        loop.add_request(Request("long", list(range(17))))
    with pytest.raises(ValueError, match=r"Request 'x' cannot fit.*slot length 20"):
        loop.add_request(Request("x", list(range(10)), max_new_tokens=11))
    with pytest.raises(ValueError, match="top_p"):
        SamplerConfig(top_p=0.0)
    with pytest.raises(ValueError, match="must end with max_prompt_len"):
        SamplerConfig(max_prompt_len=32, prompt_buckets=(8, 16))
    with pytest.raises(ValueError, match="token_budget=100 gives 25 positions per slot"):
        SamplerConfig(num_slots=4, max_prompt_len=32, token_budget=100, attention="xla")
    auto = SamplerConfig(num_slots=4, max_prompt_len=32, token_budget=100)  # the layout is not known yet
    with pytest.raises(ValueError, match="token_budget=100 gives 25 positions per slot"):
        Engine(TINY, params, MESH1, auto)  # on CPU "auto" is a slotted cache
    with pytest.raises(ValueError, match="cannot hold one prompt"):
        SamplerConfig(num_slots=4, max_prompt_len=32, token_budget=32)


def test_steady_stream_in_one_bucket_compiles_nothing(params):
    loop = _loop(params, temperature=1.0, stop_tokens=(7,), max_new_tokens=10)
    prompts = _prompts(24, seed=8, lo=9, hi=16)  # all in prompt bucket 16
    it = iter(
        [Request(i, p, n_samples=1 + i % 3, seed=i, max_new_tokens=2 + i % 9) for i, p in enumerate(prompts)]
    )
    first = [loop.step(lambda: next(it, None)) for _ in range(3)]  # warm-up compiles
    sizes, compiles = loop.engine.cache_sizes(), _COMPILES[0]
    out = sum(first, []) + loop.run(lambda: next(it, None))
    assert _COMPILES[0] == compiles and loop.engine.cache_sizes() == sizes
    assert len(out) == sum(1 + i % 3 for i in range(24))
    assert {c.finish_reason for c in out} == {"stop", "length"}
    assert all(c.tokens[-1] == 7 for c in out if c.finish_reason == "stop")
    assert all(7 not in c.tokens[:-1].tolist() for c in out)


def test_batched_prefill_matches_one_prompt_at_a_time(params):
    loop = _loop(params, prefill_batch=2, prompt_buckets=(8, 16))
    eng = loop.engine
    prompts = _prompts(5, seed=11, lo=3, hi=16)
    many = eng.prefill_many(prompts)
    for prompt, got in zip(prompts, many, strict=True):
        one = eng.prefill(prompt)
        assert (got.prompt_len, got.last_token) == (one.prompt_len, one.last_token)
        assert got.keys[0].shape[2] == eng.cfg.prompt_bucket(len(prompt)) and got.keys[0].shape[0] <= 2
        for a, b in zip(got.keys + got.values, one.keys + one.values, strict=True):
            n = len(prompt)  # positions past the prompt are padding
            np.testing.assert_allclose(np.asarray(a)[got.row, :, :n], np.asarray(b)[0, :, :n], atol=1e-5)
    # two prompt buckets x batch sizes {1, 2}, each with its prefill and insert, compiled once
    assert eng.cache_sizes()["prefill"] == eng.cache_sizes()["insert"] == 4
    # several requests admitted in one step share prefill calls and decode exactly as they would alone
    for i, prompt in enumerate(prompts):
        loop.add_request(Request(i, prompt, max_new_tokens=5))
    for c in loop.run():
        assert c.tokens.tolist() == _greedy_reference(params, prompts[c.uid], 5)
    assert loop.stats.prefills == 5 and eng.cache_sizes()["prefill"] == 4
    with pytest.raises(ValueError, match="prefill_batch"):
        SamplerConfig(prefill_batch=0)


def test_continuous_batching_beats_static_on_long_tail(params):
    lengths = [12, 2, 2, 2, 12, 2, 2, 2, 12, 2, 2, 2]
    runs = {}
    for static in (False, True):
        loop = SamplerLoop(_loop(params).engine, static_batching=static)
        for i, n in enumerate(lengths):
            loop.add_request(Request(i, [1, 2, 3], max_new_tokens=n))
        out = _by_uid(loop.run())
        runs[static] = (loop.stats.decode_steps, out)
    assert runs[False][0] < runs[True][0]
    for key, c in runs[False][1].items():
        assert c.tokens.tolist() == runs[True][1][key].tokens.tolist()


def test_sharded_engine_equals_single_device():
    mesh4 = make_mesh((2, 2), ("data", "tensor"), jax.devices()[:4])
    single, sharded = _params(mesh=MESH1), _params(mesh=mesh4)
    assert sharded["embed"].sharding.spec == SAMPLER_RULES.spec(("vocab", "embed"))
    results = []
    for p, mesh in ((single, MESH1), (sharded, mesh4)):
        loop = _loop(p, mesh=mesh)
        for i, prompt in enumerate(_prompts(6, seed=9)):
            loop.add_request(Request(i, prompt, max_new_tokens=3 + i))
        results.append({k: c.tokens.tolist() for k, c in _by_uid(loop.run()).items()})
    assert results[0] == results[1]


def test_inverse_cdf_and_truncation_masks():
    rng = np.random.default_rng(0)
    v = 300  # several vocabulary chunks
    logits = jnp.asarray(rng.normal(size=(1, v)) * 2, jnp.float32)
    probs = np.asarray(jax.nn.softmax(logits))[0]
    u = jnp.asarray(1.0 - rng.random(40000), jnp.float32)
    idx = np.asarray(sampling.inverse_cdf(jnp.broadcast_to(jnp.asarray(probs), (40000, v)), u))
    freq = np.bincount(idx, minlength=v) / len(idx)
    assert np.abs(freq - probs).max() < 0.01 and freq[probs < 1e-12].sum() == 0
    order = np.argsort(-probs)
    keep = order[: np.searchsorted(np.cumsum(probs[order]), 0.8) + 1]  # smallest set with mass >= 0.8
    for cands in (8, 1000):  # nucleus bigger than the candidates: the exact fallback path
        kept = np.flatnonzero(np.asarray(sampling.top_p_mask(logits, 0.8, cands))[0] > -1e29)
        assert sorted(kept.tolist()) == sorted(keep.tolist())
    kept = np.flatnonzero(np.asarray(sampling.top_k_mask(logits, 7))[0] > -1e29)
    assert sorted(kept.tolist()) == sorted(order[:7].tolist())


def test_generate_cli_on_hf_checkpoint(tmp_path, params):
    from jaxrl_async.tokenizer import CharTokenizer

    tok = CharTokenizer()
    cfg = presets.tiny(vocab_size=tok.vocab_size, n_layers=1, max_seq_len=64)
    p = init_params(cfg, jax.random.key(3))
    save_hf(cfg, p, str(tmp_path / "ckpt"))
    prompt = "12+34="
    cmd = [
        sys.executable,
        "-m",
        "jaxrl_async.cli.generate",
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--tokenizer",
        "char",
        "--prompt",
        prompt,
        "--max-new-tokens",
        "5",
        "--temperature",
        "0",
    ]
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    with started(cmd, env) as res:  # the reference below is computed while the command runs
        ref = _greedy_reference(p, tok.encode(prompt), 5, cfg, stop=tok.eos_id)  # the CLI stops at eos
    assert res.returncode == 0, res.stderr
    ids_lines = [line for line in res.stdout.splitlines() if line.startswith("ids:")]
    assert ids_lines == ["ids: " + " ".join(map(str, ref))]



def test_generate_cli_prompt_ids_need_no_tokenizer(tmp_path):
    # An HF directory without tokenizer.json: ids in, ids out (the tokenizer only prints text); a text
    # prompt needs one and says which flag gives it.
    cfg = presets.tiny(vocab_size=40, n_layers=1, max_seq_len=64)
    p = init_params(cfg, jax.random.key(4))
    save_hf(cfg, p, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt" / "tokenizer.json").exists()
    base = [
        sys.executable,
        "-m",
        "jaxrl_async.cli.generate",
        "--checkpoint",
        str(tmp_path / "ckpt"),
    ]
    base += ["--max-new-tokens", "4", "--temperature", "0"]
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    # Both commands and the reference at once: they are independent.
    ids, text = [*base, "--prompt-ids", "3,5,7"], [*base, "--prompt", "12+"]
    with started(ids, env) as res, started(text, env) as bad:
        ref = _greedy_reference(p, [3, 5, 7], 4, cfg, stop=cfg.eos_token_id)
    assert res.returncode == 0, res.stderr
    assert "no tokenizer found" in res.stdout
    assert [line for line in res.stdout.splitlines() if line.startswith("ids:")] == [
        "ids: " + " ".join(map(str, ref))
    ]
    assert bad.returncode != 0 and "--prompt needs a tokenizer" in bad.stderr and "--tokenizer" in bad.stderr


def _need_cxx():
    if shutil.which("g++") is None and shutil.which("c++") is None and not os.environ.get("CXX"):
        host_caps.skip("compiler", "no C++ compiler to build the CPU kernels")


def test_cpu_kernels_match_the_trainer(params):
    _need_cxx()
    temp = 0.8
    prompts = _prompts(6, seed=5)
    outs = {}
    for kernels in (("xla", "xla"), ("cpu_kernel", "xla"), ("cpu_kernel", "cpu_kernel")):
        attention, linear = kernels
        loop = _loop(params, temperature=temp, attention=attention, linear=linear, steps_per_call=3)
        for i, p in enumerate(prompts):
            loop.add_request(Request(i, p, n_samples=2, seed=i, max_new_tokens=4 + i))
        outs[kernels] = _by_uid(loop.run())
    for kernels in (("cpu_kernel", "xla"), ("cpu_kernel", "cpu_kernel")):
        for key, c in outs[kernels].items():
            ref = outs[("xla", "xla")][key]
            assert c.tokens.tolist() == ref.tokens.tolist()  # same draws: the logits agree to float rounding
            p = prompts[key[0]]
            np.testing.assert_allclose(
                c.logprobs, _trainer_logprobs(params, p, c.tokens, temp), atol=1e-5, rtol=0
            )
    packed = jax.tree.leaves(_loop(params, linear="cpu_kernel").engine.decode_params)
    assert sum(x.ndim == 3 for x in packed) == 1 + 7 * TINY.n_layers  # lm head, q, k, v, o, gate, up, down
    mesh2 = make_mesh((2, 1), ("data", "tensor"), jax.devices()[:2])
    for name in ("attention", "linear"):
        with pytest.raises(ValueError, match=f"SamplerConfig.{name}='cpu_kernel' cannot run: .*one CPU"):
            _loop(_params(mesh=mesh2), mesh=mesh2, **{name: "cpu_kernel"})
    bf16 = presets.tiny(vocab_size=64, n_layers=1, max_seq_len=64, dtype="bfloat16")
    with pytest.raises(ValueError, match="computes in bfloat16; the CPU kernels need float32"):
        _loop(_params(cfg=bf16), cfg=bf16, linear="cpu_kernel")
    with pytest.raises(ValueError, match="SamplerConfig.attention"):
        SamplerConfig(attention="flash")
    with pytest.raises(ValueError, match="SamplerConfig.linear"):
        SamplerConfig(linear="mkl")


def test_cpu_linear_kernel_with_unpackable_and_tied_weights():
    """Matrices whose rows are not a multiple of 16 (here k, v, gate and up) and a tied embedding stay with
    XLA's dots; the rest use the kernel; decoding still matches the trainer."""
    _need_cxx()
    shape = dict(n_heads=8, n_kv_heads=1, head_dim=10, ffw_size=100)  # q 80 rows; k, v 10; gate, up 100
    cfg = presets.tiny(vocab_size=61, n_layers=1, max_seq_len=64, tie_embeddings=True, **shape)
    p = _params(cfg=cfg)
    loop = _loop(p, cfg=cfg, linear="cpu_kernel", temperature=0.9)
    shapes = {k: v.shape for k, v in loop.engine.decode_params["layers"][0].items()}
    assert len(shapes["k"]) == len(shapes["gate"]) == 2 and len(shapes["q"]) == len(shapes["o"]) == 3
    prompts = _prompts(3, seed=2, hi=10)
    for i, prompt in enumerate(prompts):
        loop.add_request(Request(i, prompt, seed=i, max_new_tokens=6))
    for c in loop.run():
        np.testing.assert_allclose(
            c.logprobs, _trainer_logprobs(p, prompts[c.uid], c.tokens, 0.9, cfg), atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("m", [1, 3, 5, 13, 29, 100])
def test_cpu_linear_kernel_matches_numpy(m):
    """Every input blocking (14 / 8 / 4 / 1 rows, a second 96-row chunk), panel pairs with an odd panel left
    over, the threaded path and a one-thread call."""
    _need_cxx()
    rng = np.random.default_rng(m)
    for n, d in ((1040, 96), (16, 5)):  # 65 panels split over the pool; one tiny panel on the caller
        x = rng.standard_normal((m, d), dtype=np.float32)
        w = rng.standard_normal((n, d), dtype=np.float32)
        y = np.asarray(jax.jit(lambda x, w: cpu_kernels.linear(x, cpu_kernels.pack(w)))(x, w))
        np.testing.assert_allclose(y, x.astype(np.float64) @ w.T.astype(np.float64), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_kernels.pack(np.zeros((24, 8), np.float32))
