"""Package layering: jaxrl_async.data and jaxrl_async.rewards never import each other, and building a
RewardConfig imports nothing (each such check runs in a fresh interpreter, whose sys.modules it inspects).
Then the package's shape as its source says it, read with `ast` (every import, lazy ones inside functions
included): the import graph has no cycle, no library imports the runtime, the product commands or the
benchmarks, and the roles stay small enough to read (attribute counts of `Actor` and `Learner`)."""

import ast
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
             "jaxrl_async.tokenizer", "jaxrl_async.run_config", "jaxrl_async.paging",
             "jaxrl_async.letters", "jaxrl_async.storage", "jaxrl_async.envs")  # fmt: skip


@pytest.mark.parametrize("package", LIBRARIES)
def test_libraries_import_nothing_from_the_runtime(package):
    """The libraries know nothing of processes or messages: importing any of them (every submodule of a
    package) loads no module of jaxrl_async.runtime."""
    module_only = ("import importlib, json, sys; importlib.import_module({package!r}); "
                   "print(json.dumps(sorted(sys.modules)))")
    is_module = package.rsplit(".", 1)[-1] in ("rollouts", "sharding", "tokenizer", "run_config", "paging",
                                               "letters", "storage")  # fmt: skip
    code = (module_only if is_module else _IMPORT_ALL).format(package=package)
    modules = _modules_after(code)
    assert package in modules
    assert [m for m in modules if m.startswith("jaxrl_async.runtime")] == []


def test_the_performance_model_imports_nothing_from_the_sampler():
    """perf/ is analytic: it shares the page arithmetic through jaxrl_async.paging, below both."""
    modules = _modules_after(_IMPORT_ALL.format(package="jaxrl_async.perf"))
    assert "jaxrl_async.paging" in modules
    assert [m for m in modules if m.startswith("jaxrl_async.sampler")] == []


# ----- the import graph and the roles' size, from the source -----

PACKAGE = os.path.join(REPO, "jaxrl_async")
# What the libraries (LIBRARIES above) never import: they know nothing of processes, messages or commands.
ABOVE_LIBRARIES = ("jaxrl_async.runtime", "jaxrl_async.cli", "benchmarks")


def _modules() -> dict[str, str]:
    """Module name -> file, for every .py file of the package."""
    out = {}
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                parts = os.path.relpath(path, REPO)[: -len(".py")].split(os.sep)
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The modules `name` imports anywhere in its file, as names (a module of the package where the import
    names one, else the package or the outside module named)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package, `level` - 1 packages up
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if full in modules else base)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself): Tarjan."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue  # outside the package
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_reads_lazy_imports_and_finds_a_planted_cycle():
    """The checks below can fail: a lazy import inside a function is an edge, and a cycle through one is
    found."""
    graph = _graph()
    assert "jaxrl_async.runtime.secret" in graph["jaxrl_async.runtime.cluster"]  # imported at the top
    assert "jaxrl_async.run_config" in graph["jaxrl_async.runtime.cluster"]  # imported inside `connect`
    planted = {**graph, "jaxrl_async.runtime.secret": graph["jaxrl_async.runtime.secret"]
               | {"jaxrl_async.runtime.cluster"}}  # fmt: skip
    circle = {"jaxrl_async.runtime.cluster", "jaxrl_async.runtime.secret"}
    assert any(circle <= set(c) for c in _cycles(planted))
    planted["jaxrl_async.sampler.engine"] = graph["jaxrl_async.sampler.engine"] | {"benchmarks.bench_decode"}
    found = _upward(planted, "jaxrl_async.sampler")
    assert found == ["jaxrl_async.sampler.engine imports benchmarks.bench_decode"]


def test_the_package_import_graph_has_no_cycle():
    assert _cycles(_graph()) == []


def _upward(graph: dict[str, set[str]], library: str) -> list[str]:
    """`library`'s imports of the runtime, the commands or the benchmarks, as "module imports target"."""
    return sorted(
        f"{name} imports {target}"
        for name, targets in graph.items()
        if name == library or name.startswith(library + ".")
        for target in targets
        if any(target == a or target.startswith(a + ".") for a in ABOVE_LIBRARIES)
    )


@pytest.mark.parametrize("library", LIBRARIES)
def test_no_library_imports_the_runtime_the_commands_or_the_benchmarks(library):
    assert _upward(_graph(), library) == []


def test_the_package_never_imports_the_benchmarks():
    found = sorted(f"{n} imports {t}" for n, ts in _graph().items() for t in ts
                   if t == "benchmarks" or t.startswith("benchmarks."))  # fmt: skip
    assert found == []


def _class(source: str, cls: str) -> ast.ClassDef:
    return next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls)


def _self_attributes(source: str, cls: str) -> set[str]:
    """Names assigned as `self.x = ...` (plain, tuple-unpacked, annotated or augmented) in class `cls`."""
    node = _class(source, cls)
    names = set()
    for n in ast.walk(node):
        targets = []
        if isinstance(n, ast.Assign):
            targets = n.targets
        elif isinstance(n, ast.AnnAssign | ast.AugAssign):
            targets = [n.target]
        for t in targets:
            for e in ast.walk(t):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    names.add(e.attr)
    return names


@pytest.mark.parametrize("module, cls, most", [("runtime/actor.py", "Actor", 20),
                                               ("runtime/learner.py", "Learner", 25)])  # fmt: skip
def test_the_roles_stay_small(module, cls, most):
    """DESIGN-REVIEW: the actor had grown to 41 attributes; its parts live in classes of their own."""
    with open(os.path.join(PACKAGE, module)) as f:
        source = f.read()
    attributes = _self_attributes(source, cls)
    assert len(attributes) <= most, sorted(attributes)
    if cls == "Actor":
        node = _class(source, cls)
        assert node.end_lineno - node.lineno + 1 <= 200


def test_the_attribute_count_sees_every_form_of_assignment():
    code = ("class A:\n    def f(self):\n        self.a = 1\n        self.b, self.c = 2, 3\n"
            "        self.d: int = 4\n        self.a += 1\n        other.e = 5\n")
    assert _self_attributes(code, "A") == {"a", "b", "c", "d"}
