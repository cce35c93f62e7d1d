"""Command-line programs: console scripts, the tools/ and launch/ shims, absl flags, config files."""

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
    often = {"jaxrl-run", "jaxrl-generate", "jaxrl-perf", "jaxrl-local-cluster", "jaxrl-bench-async"}
    assert often <= set(scripts)
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        # One command per interpreter: absl flags are process-global.
        res = _python("-c", f"import {module} as m; assert callable(m.{attr}), {name!r}")
        assert res.returncode == 0, (name, res.stderr[-2000:])


@pytest.mark.parametrize(
    "shim, flag",
    [
        ("tools/generate.py", "--max-new-tokens"),
        ("tools/evaluate.py", "--steps"),
        ("tools/export_hf.py", "--out"),
        ("tools/perf_model.py", "--roles-bench"),
        ("tools/plan_check.py", "--hf-config"),
        ("tools/eta_sweep.py", "--deadline-s"),
        ("tools/bench_async.py", "--processes"),
        ("tools/bench_learning.py", "--async-processes"),
        ("tools/bench_peers.py", "--venvs"),
        ("tools/bench_checkpoint.py", "--reps"),
        ("tools/bench_decode.py", "--latency-only"),
        ("tools/bench_kernels.py", "--march"),
        ("tools/bench_rewards.py", "--[no]no-throughput"),
        ("tools/bench_roles.py", "--[no]decode_curve"),
        ("tools/bench_sync_one_process.py", "--json-out"),
        ("tools/bench_train.py", "--tail-seqs"),
        ("tools/bench_transport.py", "--tokens"),
        ("tools/bench_delta.py", "--lrs"),
        ("tools/bench_replica.py", "--steps-per-call"),
        ("tools/split_sweep.py", "--splits"),
        ("tools/window_check.py", "--max-len"),
        ("tools/device_check_report.py", "device_check.sh"),
        ("launch/run.py", "--coordinator_address"),
        ("launch/serve.py", "--max-prompt-len"),
        ("launch/local_cluster.py", "--num-processes"),
    ],
)
def test_shims_run_the_command_and_show_its_flags(shim, flag):
    res = _python(os.path.join(REPO, shim), "--help", cwd="/")
    assert res.returncode == 0, res.stderr[-2000:]  # asking for help is no failure (absl's exits 1)
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert flag in res.stdout and "Try --helpfull" in res.stdout


def test_no_tool_edits_sys_path():
    files = [os.path.join(REPO, d, "*.py") for d in ("tools", "launch", os.path.join("jaxrl_async", "cli"))]
    texts = {f: open(f).read() for f in sum((glob.glob(pattern) for pattern in files), [])}
    assert [f for f, text in texts.items() if "sys.path.insert" in text or "sys.path.append" in text] == []


def test_every_python_tool_is_a_shim_of_a_command():
    paths = glob.glob(os.path.join(REPO, "tools", "*.py")) + glob.glob(os.path.join(REPO, "launch", "*.py"))
    for path in paths:
        text = open(path).read()
        found = re.search(r"^from jaxrl_async\.cli\.(\w+) import run$", text, re.MULTILINE)
        assert found and len(text.splitlines()) <= 7, path
        assert os.path.exists(os.path.join(REPO, "jaxrl_async", "cli", found.group(1) + ".py")), path


def _defaults(shim: str) -> dict[str, str]:
    """flag -> default as `--help` shows them."""
    res = _python(shim, "--help")
    pattern = r"^  --(?:\[no\])?([\w-]+):.*?\n\s+\(default: '([^']*)'\)"
    return dict(re.findall(pattern, res.stdout, re.MULTILINE | re.DOTALL))


def test_benchmarks_sharing_the_workload_flags_keep_their_own_defaults():
    keys = ("steps", "prompts", "slots", "median", "eta")
    expected = {
        "tools/bench_async.py": dict(zip(keys, ("30", "16", "256", "24.0", "4"), strict=True)),
        "tools/split_sweep.py": dict(zip(keys, ("30", "64", "128", "24.0", "4"), strict=True)),
        "tools/window_check.py": dict(zip(keys, ("40", "8", "256", "12.0", "1"), strict=True)),
    }
    for shim, want in expected.items():
        got = _defaults(shim)
        assert {k: got.get(k) for k in want} == want, shim
        assert got["samples"] == "4" and got["max-len"] == "128" and got["layers"] == "2", shim


def test_local_cluster_passes_only_what_follows_the_separator():
    res = _python("launch/local_cluster.py", "--num-processes", "1", "stray", "--", "--config=x")
    assert res.returncode != 0 and "['stray']" in res.stdout + res.stderr and "after `--`" in res.stderr


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
    common = ["--hardware", "h100", "--devices", "8", "--eta", "2", "--prompts", "64"]
    common += ["--samples-per-prompt", "8", "--prompt-len", "256"]
    common += ["--lengths", "lognormal:median=800,p99=2000"]
    reports = []
    for model in (d, os.path.join(d, "config.json")):
        out = tmp_path / f"out{len(reports)}"
        res = _python("tools/perf_model.py", *common, "--model-json", model, "--out", str(out))
        assert res.returncode == 0, res.stderr[-2000:]
        reports.append(json.loads((out / "report.json").read_text()))
    assert reports[0]["best"] == reports[1]["best"]
    res = _python("tools/perf_model.py", *common, "--model-json", str(tmp_path), "--out", str(tmp_path / "x"))
    assert res.returncode != 0 and "--model-json" in res.stderr


def test_plan_check_takes_a_hugging_face_directory_for_the_model(tmp_path):
    d = _hf_dir(tmp_path)
    small = ["--config", os.path.join(REPO, "configs", "tiny_arith.py"), "--hardware", "h100"]
    res = _python("tools/plan_check.py", *small, "--hf-config", d, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "trainer (" in res.stdout and "fits" in res.stdout
    res = _python("tools/plan_check.py", *small, "--hf-config", str(tmp_path))
    assert res.returncode != 0 and "--hf-config" in res.stderr
