"""Package layering: jaxrl_async.data and jaxrl_async.rewards never import each other, and building a
RewardConfig imports nothing. Each check runs in a fresh interpreter, whose sys.modules it inspects."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_IMPORT_ALL = """
import importlib, json, pkgutil, sys
pkg = importlib.import_module({package!r})
for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    importlib.import_module(info.name)
print(json.dumps(sorted(sys.modules)))
"""


def _modules_after(code: str) -> list[str]:
    """sys.modules of a fresh interpreter (run from the repository root) after `code`."""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("package, forbidden", [("jaxrl_async.rewards", "jaxrl_async.data"),
                                                ("jaxrl_async.data", "jaxrl_async.rewards")])
def test_data_and_rewards_do_not_import_each_other(package, forbidden):
    modules = _modules_after(_IMPORT_ALL.format(package=package))
    assert f"{package}.synthetic" in modules  # the walk reached the submodules
    assert [m for m in modules if m == forbidden or m.startswith(forbidden + ".")] == []


def test_building_a_reward_config_imports_nothing():
    code = """
import json, sys
from jaxrl_async.rewards import RewardConfig
before = set(sys.modules)
RewardConfig(reward="math", format_weight=0.5)
RewardConfig(reward="code")
RewardConfig(reward="my_pkg.not_imported:fn", imports=("my_pkg.also_not_imported",))
print(json.dumps(sorted(set(sys.modules) - before)))
"""
    assert _modules_after(code) == []


LIBRARIES = ("jaxrl_async.model", "jaxrl_async.data", "jaxrl_async.sampler", "jaxrl_async.rewards",
             "jaxrl_async.trainer", "jaxrl_async.perf", "jaxrl_async.rollouts", "jaxrl_async.sharding",
             "jaxrl_async.tokenizer", "jaxrl_async.run_config", "jaxrl_async.paging")  # fmt: skip


@pytest.mark.parametrize("package", LIBRARIES)
def test_libraries_import_nothing_from_the_runtime(package):
    """The libraries know nothing of processes or messages: importing any of them (every submodule of a
    package) loads no module of jaxrl_async.runtime."""
    module_only = ("import importlib, json, sys; importlib.import_module({package!r}); "
                   "print(json.dumps(sorted(sys.modules)))")
    is_module = package.rsplit(".", 1)[-1] in ("rollouts", "sharding", "tokenizer", "run_config", "paging")
    code = (module_only if is_module else _IMPORT_ALL).format(package=package)
    modules = _modules_after(code)
    assert package in modules
    assert [m for m in modules if m.startswith("jaxrl_async.runtime")] == []


def test_the_performance_model_imports_nothing_from_the_sampler():
    """perf/ is analytic: it shares the page arithmetic through jaxrl_async.paging, below both."""
    modules = _modules_after(_IMPORT_ALL.format(package="jaxrl_async.perf"))
    assert "jaxrl_async.paging" in modules
    assert [m for m in modules if m.startswith("jaxrl_async.sampler")] == []
