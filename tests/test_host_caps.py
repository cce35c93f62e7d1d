"""A suite that skips for a missing host capability fails the run, unless JAXRL_CI_ALLOW_MISSING names it
(tests/host_caps.py, the hook in tests/conftest.py): here with the C++ compiler removed from PATH."""

import os
import subprocess
import sys

import host_caps
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_without_a_compiler(**env) -> subprocess.CompletedProcess:
    test = "tests/test_kernel_choice.py::test_kernels_built_for_each_instruction_set_match_numpy[native]"
    environ = {k: v for k, v in os.environ.items() if k != "CXX"}
    environ.update(PATH="/nonexistent", PYTHONPATH=REPO, **env)  # no g++ or c++ to find
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test]
    return subprocess.run(cmd, cwd=REPO, env=environ, capture_output=True, text=True, timeout=300)


def test_a_removed_compiler_fails_unless_allowed():
    res = _run_without_a_compiler()
    assert res.returncode == 1 and "1 failed" in res.stdout, res.stdout[-3000:]
    assert "[host lacks compiler]" in res.stdout and "JAXRL_CI_ALLOW_MISSING=compiler" in res.stdout
    res = _run_without_a_compiler(JAXRL_CI_ALLOW_MISSING="shm,compiler")
    assert res.returncode == 0 and "1 skipped" in res.stdout, res.stdout[-3000:]
    assert "SKIPPED [1]" in res.stdout and "[host lacks compiler]" in res.stdout


def test_unknown_capability_names_are_refused(monkeypatch):
    monkeypatch.setenv(host_caps.ALLOW_ENV, "sandbox,compilr")
    with pytest.raises(ValueError, match=r"JAXRL_CI_ALLOW_MISSING: unknown name\(s\) \['compilr'\]"):
        host_caps.allowed_missing()
    with pytest.raises(ValueError, match="unknown host capability 'gpu'"):
        host_caps.reason("gpu", "no GPU")
