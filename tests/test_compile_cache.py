"""config.compile_cache_dir: a second run loads its programs from the cache, the summary says how many, and a
directory others may write (JAX runs what it loads) is refused before anything compiles."""

import json
import os
import subprocess
import sys

import pytest

from jaxrl_async.run_config import ConfigError, validate
from jaxrl_async.runtime import compile_cache
from tests.test_orchestrator import _small

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One tiny sync run (2 steps) in a fresh process: JAX picks its cache at its first compile.
_RUN = """
import json, sys
from tests.test_orchestrator import _small
from jaxrl_async.runtime.orchestrator import run_from_config
cfg = _small(sys.argv[1], mode="sync", total_steps=2, eval_every=0, compile_cache_dir=sys.argv[2])
s = run_from_config(cfg)
print("REPORT " + json.dumps(s["compile_cache"]))
"""


def _run(workdir, cache) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")  # fmt: skip
    cmd = [sys.executable, "-c", _RUN, str(workdir), str(cache)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT ") :])


def test_a_second_run_loads_every_program_it_compiled_the_first_time(tmp_path):
    cache = tmp_path / "xla"
    first = _run(tmp_path / "a", cache)
    assert first["dir"] == str(cache) and first["entries_at_start"] == 0
    assert first["compiles"] > 5 and first["entries_at_end"] > 0  # every compile is kept, however short
    assert os.stat(cache).st_mode & 0o777 == 0o700  # created private to this user
    second = _run(tmp_path / "b", cache)
    assert second["entries_at_start"] == first["entries_at_end"]
    assert second["loaded"] == second["compiles"] == first["compiles"]
    assert second["entries_at_end"] == second["entries_at_start"]  # nothing new to write


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

