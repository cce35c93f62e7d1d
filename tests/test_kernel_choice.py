"""CPU kernels on other instruction sets, and "auto" kernels: resolved by platform, or timed on one CPU."""

import dataclasses
import platform

import host_caps
import jax
import numpy as np
import pytest
from test_sampler import MESH1, TINY, _by_uid, _params, _prompts

from jaxrl_async.model import presets
from jaxrl_async.sampler import Engine, Request, SamplerConfig, SamplerLoop, cpu_kernels, kernel_choice
from jaxrl_async.sampler.engine import _kernel_timing, _timing_runner
from jaxrl_async.sharding import make_mesh

X86 = platform.machine() in ("x86_64", "AMD64")


def _need_cxx():
    if not cpu_kernels.compiler_available():
        host_caps.skip("compiler", "no C++ compiler to build the CPU kernels")


@pytest.mark.parametrize("march", ["native", "x86-64-v3", "x86-64"])
def test_kernels_built_for_each_instruction_set_match_numpy(march):
    """The register blocking follows the ISA the library is built for (AVX-512 14x2, AVX2 6x1, SSE 2x1);
    an x86 host that has AVX-512 also runs the AVX2 and SSE builds, so all three are checked here."""
    _need_cxx()
    if march != "native" and not X86:
        pytest.skip("x86 -march values")
    isa, blocking = cpu_kernels.kernel_info(march).split()
    if march == "x86-64-v3":
        assert (isa, blocking) == ("avx2", "6x1")
    if march == "x86-64":
        assert (isa, blocking) == ("sse", "2x1")
    rng = np.random.default_rng(0)
    linear = jax.jit(lambda x, w: cpu_kernels.linear(x, cpu_kernels.pack(w), march=march))
    for m in (1, 3, 7, 16, 37):  # whole blocks and every remainder block of each blocking
        x = rng.standard_normal((m, 96), dtype=np.float32)
        w = rng.standard_normal((1040, 96), dtype=np.float32)
        ref = x.astype(np.float64) @ w.T.astype(np.float64)
        np.testing.assert_allclose(np.asarray(linear(x, w)), ref, atol=1e-4, rtol=1e-5)
    q = rng.standard_normal((3, 2, 2, 16), dtype=np.float32)
    kc = rng.standard_normal((3, 2, 24, 16), dtype=np.float32)
    vc = rng.standard_normal((3, 2, 24, 16), dtype=np.float32)
    n = np.asarray([1, 13, 24], np.int32)
    out = np.asarray(jax.jit(lambda *a: cpu_kernels.decode_attention(*a, march=march))(q, kc, vc, n))
    for b in range(3):
        s = np.einsum("grk,gsk->grs", q[b], kc[b, :, : n[b]]) / 4.0
        p = np.exp(s - s.max(-1, keepdims=True))
        ref = np.einsum("grs,gsk->grk", p / p.sum(-1, keepdims=True), vc[b, :, : n[b]])
        np.testing.assert_allclose(out[b], ref, atol=1e-5)


def test_auto_resolves_by_platform_and_limits(params):
    cfg = SamplerConfig(num_slots=2, max_prompt_len=8, max_new_tokens=8)
    assert (cfg.attention, cfg.linear) == ("auto", "auto")
    never = lambda c: pytest.fail("nothing should be timed")
    mesh2 = make_mesh((2, 1), ("data", "tensor"), jax.devices()[:2])
    c = kernel_choice.resolve(TINY, mesh2, cfg, never, min_bytes=0)
    assert (c.attention, c.linear, c.how) == ("xla", "xla", "platform") and "2 cpu device" in c.reason
    bf16 = presets.tiny(vocab_size=64, dtype="bfloat16")
    assert "bfloat16" in kernel_choice.resolve(bf16, MESH1, cfg, never, min_bytes=0).reason
    assert "compile-only" in kernel_choice.resolve(TINY, MESH1, cfg, None, min_bytes=0).reason
    small = kernel_choice.resolve(TINY, MESH1, cfg, never)
    assert small.attention == small.linear == "xla" and "MiB of weights" in small.reason
    explicit = SamplerConfig(num_slots=2, max_prompt_len=8, max_new_tokens=8, attention="xla", linear="xla")
    assert kernel_choice.resolve(TINY, MESH1, explicit, never).how == "explicit"
    paged = SamplerConfig(num_slots=2, max_prompt_len=8, max_new_tokens=8, attention="paged_kernel")
    assert kernel_choice.resolve(TINY, MESH1, paged, never, min_bytes=0).linear == "xla"
    # The engine reports what it resolved to, and its config holds concrete kernels.
    eng = Engine(TINY, params, MESH1, cfg)
    assert (eng.cfg.attention, eng.cfg.linear) == ("xla", "xla") and eng.kernel_choice.how == "platform"


def test_auto_keeps_the_fastest_candidate_and_caches_the_decision():
    """The timing logic on an injected clock: each candidate's call advances it by that candidate's cost,
    so what is checked (the faster one wins, the ms per step, the alternation, the cache) does not depend
    on how loaded the host is."""
    _need_cxx()
    cfg = SamplerConfig(num_slots=2, max_prompt_len=8, max_new_tokens=8, steps_per_call=2)
    cfg = dataclasses.replace(cfg, linear="cpu_kernel")
    cost = {("xla", "cpu_kernel"): 0.004, ("cpu_kernel", "cpu_kernel"): 0.001}
    calls, now = [], [100.0]

    def make_runner(c):
        def run():
            calls.append((c.attention, c.linear))
            now[0] += cost[(c.attention, c.linear)]

        return run

    model = TINY.replace(n_layers=3)  # a model config no other test times
    c = kernel_choice.resolve(model, MESH1, cfg, make_runner, rounds=3, min_bytes=0, clock=lambda: now[0])
    assert (c.attention, c.linear, c.how) == ("cpu_kernel", "cpu_kernel", "timed")
    # ms per decode step: a call is steps_per_call = 2 steps.
    assert c.step_ms == pytest.approx({"xla/cpu_kernel": 2.0, "cpu_kernel/cpu_kernel": 0.5})
    assert calls == [("xla", "cpu_kernel"), ("cpu_kernel", "cpu_kernel")] * 4  # warm-up, then 3 rounds
    again = kernel_choice.resolve(model, MESH1, cfg, make_runner, min_bytes=0, clock=lambda: now[0])
    assert (again.attention, again.how, len(calls)) == ("cpu_kernel", "cached", 8)


def test_auto_times_real_engines_and_decodes_like_xla(params):
    """The real timing path on a tiny model (lowering the size threshold): all four candidates compile and
    run, and the chosen engine decodes the same tokens as the all-XLA one."""
    _need_cxx()
    cfg = SamplerConfig(num_slots=2, max_prompt_len=8, max_new_tokens=6, steps_per_call=2, temperature=0.0)
    runner = lambda c: _timing_runner(TINY, params, MESH1, c)
    choice = kernel_choice.resolve(TINY, MESH1, cfg, runner, rounds=1, min_bytes=0)
    assert choice.how in ("timed", "cached") and len(choice.step_ms) == 4
    assert all(t > 0 for t in choice.step_ms.values())
    prompts = _prompts(3, seed=4, hi=8)
    outs = []
    for attention, linear in (("xla", "xla"), (choice.attention, choice.linear)):
        concrete = dataclasses.replace(cfg, attention=attention, linear=linear)
        loop = SamplerLoop(Engine(TINY, params, MESH1, concrete))
        for i, p in enumerate(prompts):
            loop.add_request(Request(i, p, max_new_tokens=6))
        outs.append({k: v.tokens.tolist() for k, v in _by_uid(loop.run()).items()})
    assert outs[0] == outs[1]


def test_an_engine_built_before_its_weights_times_auto_on_random_ones():
    """The runtime builds its engines before the first version arrives (params=None). With time_kernels
    they still time "auto" (here the size limit answers first; with no limit the timing runs on random
    weights); a compile-only engine has nothing to time with."""
    _need_cxx()
    cfg = SamplerConfig(num_slots=2, max_prompt_len=8, max_new_tokens=6, steps_per_call=2)
    assert "compile-only" in Engine(TINY, None, MESH1, cfg).kernel_choice.reason
    assert "MiB of weights" in Engine(TINY, None, MESH1, cfg, time_kernels=True).kernel_choice.reason
    model = TINY.replace(n_layers=1)  # a model config no other test times
    runner = _kernel_timing(model, None, MESH1, time_kernels=True)  # what such an engine times with
    assert _kernel_timing(model, None, MESH1, time_kernels=False) is None
    choice = kernel_choice.resolve(model, MESH1, cfg, runner, rounds=1, min_bytes=0)
    assert choice.how == "timed" and len(choice.step_ms) == 4 and all(t > 0 for t in choice.step_ms.values())
    assert choice.describe().startswith(f"attention {choice.attention}, linear {choice.linear} (timed: ")
    assert choice.describe().count(" ms a step: ") == 1 and "xla/xla " in choice.describe()


@pytest.fixture(scope="module")
def params():
    return _params()
