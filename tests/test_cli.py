"""Command-line programs: console scripts, launch/'s entry points, the benchmarks, flags, config files."""

import glob
import json
import os
import re
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
    often = {"jaxrl-run", "jaxrl-generate", "jaxrl-perf", "jaxrl-local-cluster", "jaxrl-plan-check"}
    assert often <= set(scripts)
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        # One command per interpreter: absl flags are process-global.
        res = _python("-c", f"import {module} as m; assert callable(m.{attr}), {name!r}")
        assert res.returncode == 0, (name, res.stderr[-2000:])


def _command(name: str) -> list[str]:
    """How a user starts `name`: a console script (its module's `run`), a launcher, or a benchmark module."""
    if name.startswith("jaxrl-"):
        module, _, attr = _scripts()[name].partition(":")
        return ["-c", f"import sys; sys.argv[0] = {name!r}; from {module} import {attr}; {attr}()"]
    return [os.path.join(REPO, name)] if name.endswith(".py") else ["-m", name]


@pytest.mark.parametrize(
    "command, flag",
    [
        ("jaxrl-generate", "--max-new-tokens"),
        ("jaxrl-evaluate", "--steps"),
        ("jaxrl-export-hf", "--out"),
        ("jaxrl-perf", "--roles-bench"),
        ("jaxrl-plan-check", "--hf-config"),
        ("jaxrl-check-layout", "--accelerator"),
        ("benchmarks.eta_sweep", "--deadline-s"),
        ("benchmarks.bench_async", "--processes"),
        ("benchmarks.bench_learning", "--async-processes"),
        ("benchmarks.bench_peers", "--venvs"),
        ("benchmarks.bench_checkpoint", "--reps"),
        ("benchmarks.bench_decode", "--latency-only"),
        ("benchmarks.bench_kernels", "--march"),
        ("benchmarks.bench_rewards", "--[no]no-throughput"),
        ("benchmarks.bench_roles", "--[no]decode_curve"),
        ("benchmarks.bench_sync_one_process", "--json-out"),
        ("benchmarks.bench_train", "--tail-seqs"),
        ("benchmarks.bench_transport", "--tokens"),
        ("benchmarks.bench_delta", "--lrs"),
        ("benchmarks.bench_replica", "--steps-per-call"),
        ("benchmarks.chaos", "--scenario"),
        ("benchmarks.split_sweep", "--splits"),
        ("benchmarks.window_check", "--max-len"),
        ("benchmarks.device_check_report", "device_check.sh"),
        ("launch/run.py", "--coordinator_address"),
        ("launch/serve.py", "--max-prompt-len"),
        ("launch/local_cluster.py", "--num-processes"),
    ],
)
def test_each_command_starts_its_one_way_and_shows_its_flags(command, flag):
    res = _python(*_command(command), "--help")  # benchmarks run from the checkout
    assert res.returncode == 0, res.stderr[-2000:]  # asking for help is no failure (absl's exits 1)
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert flag in res.stdout and "Try --helpfull" in res.stdout


def test_no_command_edits_sys_path():
    dirs = ("launch", "benchmarks", os.path.join("jaxrl_async", "cli"))
    files = sum((glob.glob(os.path.join(REPO, d, "*.py")) for d in dirs), [])
    texts = {f: open(f).read() for f in files}
    assert [f for f, text in texts.items() if "sys.path.insert" in text or "sys.path.append" in text] == []


def test_launch_scripts_are_entry_points_of_product_commands():
    for path in glob.glob(os.path.join(REPO, "launch", "*.py")):
        text = open(path).read()
        found = re.search(r"^from jaxrl_async\.cli\.(\w+) import run$", text, re.MULTILINE)
        assert found and len(text.splitlines()) <= 7, path
        assert os.path.exists(os.path.join(REPO, "jaxrl_async", "cli", found.group(1) + ".py")), path


def test_the_package_ships_no_benchmark_and_never_imports_one():
    package = os.path.join(REPO, "jaxrl_async")
    names = [os.path.basename(f) for f in glob.glob(os.path.join(package, "**", "*.py"), recursive=True)]
    assert not [n for n in names if n.startswith("bench_")]
    for f in glob.glob(os.path.join(package, "**", "*.py"), recursive=True):
        text = open(f).read()
        assert not re.search(r"^\s*(from|import) benchmarks\b", text, re.MULTILINE), f


def _defaults(command: str) -> dict[str, str]:
    """flag -> default as `--help` shows them."""
    res = _python(*_command(command), "--help")
    pattern = r"^  --(?:\[no\])?([\w-]+):.*?\n\s+\(default: '([^']*)'\)"
    return dict(re.findall(pattern, res.stdout, re.MULTILINE | re.DOTALL))


def test_benchmarks_sharing_the_workload_flags_keep_their_own_defaults():
    keys = ("steps", "prompts", "slots", "median", "max-staleness")
    expected = {
        "benchmarks.bench_async": dict(zip(keys, ("30", "16", "256", "24.0", "4"), strict=True)),
        "benchmarks.split_sweep": dict(zip(keys, ("30", "64", "128", "24.0", "4"), strict=True)),
        "benchmarks.window_check": dict(zip(keys, ("40", "8", "256", "12.0", "1"), strict=True)),
    }
    for command, want in expected.items():
        got = _defaults(command)
        assert {k: got.get(k) for k in want} == want, command
        assert got["samples"] == "4" and got["max-len"] == "128" and got["layers"] == "2", command


def test_local_cluster_passes_only_what_follows_the_separator():
    res = _python("launch/local_cluster.py", "--num-processes", "1", "stray", "--", "--config=x")
    assert res.returncode != 0 and "['stray']" in res.stdout + res.stderr and "after `--`" in res.stderr


def test_config_files_load_without_the_repository_on_sys_path():
    # The way `--config=configs/x.py` loads them (by path); `configs` must not be imported as a package.
    code = (
        "import sys\n"
        "from ml_collections.config_flags.config_flags import _LoadConfigModule\n"
        "for name in ('configs/tiny_arith', 'benchmarks/configs/bench_async', 'configs/math_8b',\n"
        "             'configs/qwen_1p5b_math'):\n"
        f"    m = _LoadConfigModule(name, {REPO!r} + f'/{{name}}.py')\n"
        "    assert m.get_config().workdir is not None\n"
        "assert not [k for k in sys.modules if k == 'configs' or k.startswith('configs.')]\n"
    )
    res = _python("-c", code, cwd="/")
    assert res.returncode == 0, res.stderr[-2000:]


def test_generate_names_a_bad_prompt_ids_flag():
    flags = ["--checkpoint", "/nonexistent", "--prompt-ids", "1,x", "--max-new-tokens", "2"]
    res = _python(*_command("jaxrl-generate"), *flags)
    assert res.returncode != 0 and "--prompt-ids" in res.stderr and "1,x" in res.stderr


def _hf_dir(tmp_path) -> str:
    """A Hugging Face directory with only its config.json (a tiny shape): no weights."""
    from jaxrl_async.model import presets
    from jaxrl_async.model.config import to_hf_config

    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(to_hf_config(presets.tiny(vocab_size=256, n_layers=2))))
    return str(d)


def test_perf_model_takes_a_hugging_face_directory_for_the_model(tmp_path):
    d = _hf_dir(tmp_path)
    common = ["--hardware", "h100", "--devices", "8", "--max-staleness", "2", "--prompts", "64"]
    common += ["--samples-per-prompt", "8", "--prompt-len", "256"]
    common += ["--lengths", "lognormal:median=800,p99=2000"]
    reports = []
    for model in (d, os.path.join(d, "config.json")):
        out = tmp_path / f"out{len(reports)}"
        res = _python(*_command("jaxrl-perf"), *common, "--model-json", model, "--out", str(out))
        assert res.returncode == 0, res.stderr[-2000:]
        reports.append(json.loads((out / "report.json").read_text()))
    assert reports[0]["best"] == reports[1]["best"]
    perf = _command("jaxrl-perf")
    res = _python(*perf, *common, "--model-json", str(tmp_path), "--out", str(tmp_path / "x"))
    assert res.returncode != 0 and "--model-json" in res.stderr


def test_plan_check_takes_a_hugging_face_directory_for_the_model(tmp_path):
    d = _hf_dir(tmp_path)
    small = ["--config", os.path.join(REPO, "configs", "tiny_arith.py"), "--hardware", "h100"]
    res = _python(*_command("jaxrl-plan-check"), *small, "--hf-config", d, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "trainer (" in res.stdout and "fits" in res.stdout
    res = _python(*_command("jaxrl-plan-check"), *small, "--hf-config", str(tmp_path))
    assert res.returncode != 0 and "--hf-config" in res.stderr
