"""config.compile_cache_dir: a second run loads its programs from the cache, the summary says how many, and a
directory others may write (JAX runs what it loads) is refused before anything compiles; a sampler process
other than 0 keeps its own executables (the store), and a second run loads them."""

import json
import os
import re

import pytest

from jaxrl_async.run_config import ConfigError, validate
from jaxrl_async.runtime import compile_cache
from tests.test_orchestrator import _small


def test_a_directory_others_may_write_is_refused_naming_the_field(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    others = r"config\.compile_cache_dir=.*group or others may write"
    with pytest.raises(compile_cache.CacheError, match=others):
        compile_cache.check_dir(str(shared))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(compile_cache.CacheError, match=r"config\.compile_cache_dir=.*not a directory"):
        compile_cache.check_dir(str(a_file))
    # The run refuses it as a config error, before it builds anything.
    from jaxrl_async.runtime.orchestrator import run_from_config

    with pytest.raises(ConfigError, match=others):
        run_from_config(_small(tmp_path / "run", compile_cache_dir=str(shared)))
    with pytest.raises(ConfigError, match=r"config\.compile_cache_dir: a directory path"):
        validate(_small(tmp_path / "run", compile_cache_dir=None), None)


def _sample(store, mesh):
    """Every completion (tokens, rounded logprobs) of a small sampled batch on a fresh engine whose programs
    come from `store`."""
    import numpy as np

    from jaxrl_async.sampler import Engine, Request, SamplerConfig, SamplerLoop
    from tests.test_sampler import TINY, _params, _prompts

    scfg = SamplerConfig(num_slots=4, max_prompt_len=16, max_new_tokens=12, steps_per_call=4, temperature=1.0)
    compile_fn = store.compiler(mesh.devices.flat)
    loop = SamplerLoop(Engine(TINY, _params(mesh=mesh), mesh, scfg, compile_fn=compile_fn))
    for i, p in enumerate(_prompts(6)):
        loop.add_request(Request(uid=i, prompt_tokens=tuple(p), n_samples=2, seed=i))
    done = loop.run()
    return sorted((c.uid, c.sample_index, tuple(c.tokens), tuple(np.round(c.logprobs, 5))) for c in done)


def test_the_executable_store_loads_what_it_kept_and_rewrites_what_does_not_load(tmp_path, caplog):
    import jax

    from jaxrl_async.sharding import make_mesh

    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    store = compile_cache.ExecutableStore(str(tmp_path / "executables"))
    first = _sample(store, mesh)
    kept = store.compiled
    assert kept >= 4 and store.written == kept and store.loaded == 0
    assert len(os.listdir(tmp_path / "executables")) == kept
    assert os.stat(tmp_path / "executables").st_mode & 0o777 == 0o700
    # A fresh engine (as in the next run) loads every program and samples the same tokens and logprobs.
    again = compile_cache.ExecutableStore(str(tmp_path / "executables"))
    assert _sample(again, mesh) == first
    assert (again.loaded, again.compiled, again.written) == (kept, 0, 0)
    # A truncated entry (a process killed while writing one by hand) is compiled again and rewritten.
    victim = sorted(os.listdir(tmp_path / "executables"))[0]
    with open(tmp_path / "executables" / victim, "r+b") as f:
        f.truncate(100)
    third = compile_cache.ExecutableStore(str(tmp_path / "executables"))
    assert _sample(third, mesh) == first
    assert (third.loaded, third.compiled, third.written) == (kept - 1, 1, 1)
    assert "did not load" in caplog.text and victim in caplog.text
    # Another device is another key: nothing is loaded onto the device it was not compiled for.
    other = make_mesh((1, 1), ("data", "tensor"), jax.devices()[1:2])
    fourth = compile_cache.ExecutableStore(str(tmp_path / "executables"))
    _sample(fourth, other)
    assert fourth.loaded == 0 and fourth.compiled == kept


def test_a_second_run_loads_every_program_and_a_sampler_process_its_own(tmp_path):
    """Two 2-process runs (learner on process 0, sampler on process 1) on one fresh cache directory. The
    lead uses JAX's cache, as a one-process run does (`compile_cache.enable` is the same call): the first
    run compiles and keeps every program, the second loads every one of them and adds nothing. JAX writes
    cache entries from process 0 only: the sampler process keeps its engines' executables in the store,
    and the second run's sampler process loads every one of them. (One test for both: each claim needs a
    first and a second run, and these two runs make both.)"""
    from tests.test_multiprocess import _flags, _launch

    cache = tmp_path / "xla"
    lines, lead = [], []
    for run in ("a", "b"):
        flags = _flags(tmp_path / run, total_steps=2, eval_every=0, compile_cache_dir=str(cache),
                       **{"mesh.sampler_processes": "(1,)", "mesh.trainer_processes": "(0,)"})  # fmt: skip
        res = _launch(2, 1, flags)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        text = res.stdout + res.stderr
        own = r"\[p1\].*the sampler's own executables: (\d+) loaded, (\d+) compiled, (\d+) kept"
        lines.append(re.search(own, text))
        assert lines[-1], text[-3000:]
        with open(tmp_path / run / "summary.json") as f:
            summary = json.load(f)
        lead.append(summary["compile_cache"])
        assert lead[-1]["executables"] is None  # process 0: JAX's cache serves it
        # The learner's summary has what the sampler process's store did, as its log line says.
        own = summary["sampler_executables"]["actor:0"]
        assert (own["loaded"], own["compiled"], own["written"]) == tuple(map(int, lines[-1].groups()))
    first, second = lead
    assert first["dir"] == str(cache) and first["entries_at_start"] == 0
    assert first["compiles"] > 5 and first["entries_at_end"] > 0  # every compile is kept, however short
    assert os.stat(cache).st_mode & 0o777 == 0o700  # created private to this user
    assert second["entries_at_start"] == first["entries_at_end"]
    assert second["loaded"] == second["compiles"] == first["compiles"]
    assert second["entries_at_end"] == second["entries_at_start"]  # nothing new to write
    loaded, compiled, kept = map(int, lines[0].groups())
    assert compiled >= 4 and kept == compiled
    assert tuple(map(int, lines[1].groups())) == (loaded + compiled, 0, 0)


def test_a_store_that_cannot_write_still_returns_the_compiled_program(tmp_path, monkeypatch, caplog):
    import jax

    from jaxrl_async.sharding import make_mesh

    def full_disk(*_a, **_k):
        raise OSError(28, "No space left on device")

    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    store = compile_cache.ExecutableStore(str(tmp_path / "executables"))
    monkeypatch.setattr(compile_cache.tempfile, "NamedTemporaryFile", full_disk)
    assert _sample(store, mesh)  # the run goes on: it samples with what it compiled
    assert store.compiled >= 4 and store.written == 0 and os.listdir(tmp_path / "executables") == []
    assert "not kept" in caplog.text and "No space left" in caplog.text
