"""Command-line programs: console scripts, the tools/ and launch/ shims, absl flags, config files."""

import glob
import os
import subprocess
import sys
import tomllib

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")  # the package of this checkout


def _python(*args, cwd=REPO, timeout=240):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _scripts() -> dict[str, str]:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def test_console_scripts_name_a_run_function():
    scripts = _scripts()
    assert {"jaxrl-run", "jaxrl-generate", "jaxrl-perf"} <= set(scripts)
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        # One command per interpreter: absl flags are process-global.
        res = _python("-c", f"import {module} as m; assert callable(m.{attr}), {name!r}")
        assert res.returncode == 0, (name, res.stderr[-2000:])


@pytest.mark.parametrize(
    "shim, flag",
    [
        ("tools/generate.py", "--max-new-tokens"),
        ("tools/export_hf.py", "--out"),
        ("tools/perf_model.py", "--roles-bench"),
        ("tools/plan_check.py", "--hf-config"),
        ("launch/run.py", "--coordinator_address"),
    ],
)
def test_shims_run_the_command_and_show_its_flags(shim, flag):
    res = _python(os.path.join(REPO, shim), "--help", cwd="/")  # absl's --help exits with 1
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert flag in res.stdout and "Try --helpfull" in res.stdout


def test_no_tool_edits_sys_path():
    files = glob.glob(os.path.join(REPO, "tools", "*.py")) + [os.path.join(REPO, "launch", "run.py")]
    texts = {f: open(f).read() for f in files}
    assert [f for f, text in texts.items() if "sys.path.insert" in text or "sys.path.append" in text] == []


def test_config_files_load_without_the_repository_on_sys_path():
    # The way `--config=configs/x.py` loads them (by path); `configs` must not be imported as a package.
    code = (
        "import sys\n"
        "from ml_collections.config_flags.config_flags import _LoadConfigModule\n"
        "for name in ('tiny_arith', 'bench_async', 'math_8b', 'qwen_1p5b_math'):\n"
        f"    m = _LoadConfigModule(name, {REPO!r} + f'/configs/{{name}}.py')\n"
        "    assert m.get_config().workdir is not None\n"
        "assert not [k for k in sys.modules if k == 'configs' or k.startswith('configs.')]\n"
    )
    res = _python("-c", code, cwd="/")
    assert res.returncode == 0, res.stderr[-2000:]


def test_generate_names_a_bad_prompt_ids_flag():
    flags = ["--checkpoint", "/nonexistent", "--prompt-ids", "1,x", "--max-new-tokens", "2"]
    res = _python("tools/generate.py", *flags)
    assert res.returncode != 0 and "--prompt-ids" in res.stderr and "1,x" in res.stderr
