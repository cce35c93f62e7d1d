"""Test set-up: an 8-device fake CPU mesh, created before JAX is first imported."""

import os

# LLVM's optimisations off: the suite's programs are tiny and mostly compiled to be run once, so XLA:CPU's
# code generation at -O2 cost more than the programs ever run (test_sampler.py 134 -> 89 CPU-s,
# test_train_step.py 149 -> 86). HLO passes (fusion, layout, buffer assignment) are unchanged; only the
# machine code of each fused kernel is less optimised, which tests of numerics and bit identity compare
# like with like. Processes a test starts inherit it unless the test sets XLA_FLAGS itself.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# One persistent XLA compilation cache for the whole run, the subprocesses included (they inherit the
# environment): the suite compiles the same tiny-model programs again in dozens of processes (a run of
# tests/test_rehearsal.py took 66 s with a cold cache, 51 s with a warm one). Every compile is kept,
# however short; the folder is the run's own and goes when the run ends.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _xla_cache = tempfile.mkdtemp(prefix="jaxrl_async_tests_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _xla_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)
    # The same folder as the runs' config.compile_cache_dir, for the multi-process runs' configs that read
    # this variable: JAX writes cache entries from process 0 only, so without it every sampler process of
    # every multi-process test compiled all its programs again (about half of such a run's CPU time); with
    # it those processes keep theirs in the folder's executable store (runtime/compile_cache.py) and later
    # runs load them. Set only for a folder made here (private to this user, as the store requires).
    os.environ["JAXRL_TESTS_COMPILE_CACHE_DIR"] = _xla_cache

import sys  # noqa: E402

# configs/ is a directory of config files at the repository root, not an installed package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import host_caps  # noqa: E402  (tests/ is on sys.path: pytest imports this conftest from it)
import pytest  # noqa: E402

_ALLOWED_MISSING = host_caps.allowed_missing()  # read once: a bad name fails the run at collection


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip for a missing host capability (tests/host_caps.py) becomes a failure, unless
    JAXRL_CI_ALLOW_MISSING names that capability: a host without a compiler or user namespaces would
    otherwise pass CI with whole suites unrun."""
    outcome = yield
    rep = outcome.get_result()
    if not rep.skipped or not isinstance(rep.longrepr, tuple):
        return
    why = rep.longrepr[2]
    cap = host_caps.capability_of(why)
    if cap is None or cap in _ALLOWED_MISSING:
        return
    rep.outcome = "failed"
    rep.longrepr = (
        f"{why}\nThis suite needs {host_caps.CAPABILITIES[cap]}, which CI's hosts have: its skip fails. "
        f"On a host that cannot have it, set {host_caps.ALLOW_ENV}={cap} to let it skip."
    )


@pytest.fixture(scope="session")
def bucket(tmp_path_factory):
    """gs://jaxrl-test served on localhost by a GCS emulator for the whole session (one process; tests
    keep to prefixes of their own). Its environment is set in os.environ, which subprocesses inherit."""
    pytest.importorskip("gcp_storage_emulator", reason="the 'test' extra's GCS emulator")
    from jaxrl_async.cli.local_bucket import LocalBucket

    log = tmp_path_factory.mktemp("bucket") / "emulator.log"  # every request, for a failure's post-mortem
    with LocalBucket("jaxrl-test", log_path=str(log)) as b:
        yield b
