"""The documentation a newcomer meets: README stays short and its commands work as written, docs/index.md
links every page, relative links resolve, and every results table says how to reproduce it."""

import glob
import os
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
# README's run commands run as in a fresh shell: no fake-device flags. Only LLVM's optimisations are off, as
# in the rest of the suite (tests/conftest.py): what they check does not depend on machine-code speed.
_NO_FAKE_DEVICES = "--xla_backend_optimization_level=0"
DOCS = os.path.join(REPO, "docs")
# The pages whose links must resolve: every page a reader can reach, the lab notebook included.
PAGES = [README, os.path.join(REPO, "CONTRIBUTING.md"), os.path.join(REPO, "benchmarks", "README.md"),
         *sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def _section(text: str, heading: str) -> str:
    """The body of the `## heading` section."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert m, f"README.md has no '## {heading}' section"
    return m.group(1)


def _anchors(path: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"^```.*?^```", "", _read(path), flags=re.MULTILINE | re.DOTALL)
    heads = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_readme_is_short():
    text = _read(README)
    assert len(text.splitlines()) <= 200, "README.md over 200 lines: move detail to docs/"
    assert len(text.split()) <= 1800, "README.md over 1,800 words: move detail to docs/"


def test_readme_names_no_run_letters_or_dates():
    """What is true now, not what one afternoon measured: runs, dates and seeds live in docs/history/."""
    text = _read(README)
    assert not re.findall(r"\bruns? [A-Z][0-9]?\b", text)
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text)


def test_the_index_links_every_page():
    index = os.path.join(DOCS, "index.md")
    targets = {os.path.normpath(os.path.join(DOCS, t.split("#")[0])) for t in LINK.findall(_read(index))}
    pages = {os.path.normpath(p) for p in glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)}
    assert sorted(pages - targets - {os.path.normpath(index)}) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, REPO))
def test_relative_links_resolve_to_files_and_headings(page):
    broken = []
    for target in LINK.findall(_read(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(dest):
            broken.append(target)
        elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
            broken.append(target)
    assert broken == [], f"{os.path.relpath(page, REPO)}: links that lead nowhere"


def test_results_are_short_and_every_table_has_its_command():
    text = _read(os.path.join(DOCS, "results.md"))
    assert len(text.splitlines()) <= 400
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    assert len(sections) >= 8
    for section in sections:
        if not re.search(r"^\|.*\|\s*$", section, re.MULTILINE):
            continue
        commands = [line for block in _code_blocks(section) for line in block.splitlines()
                    if re.match(r"\s*(python|jaxrl-|benchmarks/|JAX_PLATFORMS=|for )", line)]  # fmt: skip
        assert commands, f"results.md '## {section.splitlines()[0]}': a table without the command beside it"


def test_every_tag_a_run_always_writes_is_documented():
    from jaxrl_async.runtime.metrics import SCALAR_TAGS

    text = _read(os.path.join(DOCS, "configuration.md"))
    assert [tag for tag in SCALAR_TAGS if f"`{tag}`" not in text] == []


def _ci_first_command() -> str:
    lines = [line.strip() for line in _read(os.path.join(REPO, ".ci", "run")).splitlines()]
    return next(line for line in lines if line and not line.startswith(("#", "set ", "cd ")))


def test_the_readme_test_command_is_what_ci_runs_first():
    blocks = _code_blocks(_section(_read(README), "Run the tests"))
    assert [block.strip() for block in blocks] == [_ci_first_command()]


def _readme_main_job() -> list[str]:
    lines = [line for block in _code_blocks(_read(README)) for line in block.splitlines()]
    main = "python launch/run.py --config=configs/tiny_arith.py"
    (job,) = [line for line in lines if line.startswith(main)]
    return shlex.split(job)


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """README's main job, verbatim, made cheap by overrides appended after it (a later flag wins): one
    step of 8 prompts, no warm start, a tiny evaluation; in a fresh shell's environment (no fake-device
    flags)."""
    workdir = str(tmp_path_factory.mktemp("main_job"))
    argv = _readme_main_job()
    assert argv[0] == "python"
    cheap = [f"--config.workdir={workdir}", "--config.total_steps=1", "--config.warm_start.enabled=False",
             "--config.eval_prompts=8", "--config.eval_every=0", "--config.prompts_per_step=8"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", XLA_FLAGS=_NO_FAKE_DEVICES)
    res = subprocess.run([sys.executable, *argv[1:], *cheap], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    return workdir, env, res


def test_the_readme_main_job_runs_and_writes_tensorboard_events(main_job):
    workdir, _, res = main_job
    assert res.returncode == 0, res.stderr[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(os.path.join(workdir, "tb", "events.out.tfevents.*"))
    acc = EventAccumulator(events)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward/mean", "eval/accuracy", "perf/train_tokens_per_s"} <= tags, sorted(tags)
    # README's TensorBoard line reads the config's own workdir's tb/.
    assert "tensorboard --logdir runs/tiny_arith/tb" in _read(README)
    assert "--config.workdir=runs/tiny_arith" in _readme_main_job()


def test_the_readmes_other_run_commands_run_verbatim_in_cheap_forms(tmp_path):
    """Every other `python launch/run.py` line of README (LoRA, multi-turn tools), verbatim with overrides
    appended (a later flag wins): one step, no warm start, a tiny evaluation; the runs side by side."""
    lines = [line for block in _code_blocks(_read(README)) for line in block.splitlines()]
    others = [line for line in lines if line.startswith("python launch/run.py --config=configs/")
              and not line.startswith("python launch/run.py --config=configs/tiny_arith.py")]  # fmt: skip
    assert {"configs/tiny_arith_lora.py", "configs/calc_tool.py"} <= {
        shlex.split(line)[2].partition("=")[2] for line in others
    }
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", XLA_FLAGS=_NO_FAKE_DEVICES)
    procs = []
    for i, line in enumerate(others):
        cheap = [f"--config.workdir={tmp_path / str(i)}", "--config.total_steps=1",
                 "--config.warm_start.enabled=False", "--config.eval_prompts=8", "--config.eval_every=0",
                 "--config.prompts_per_step=8"]  # fmt: skip
        argv = shlex.split(line)
        procs.append(subprocess.Popen([sys.executable, *argv[1:], *cheap], cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    try:
        for line, proc in zip(others, procs, strict=True):
            _, stderr = proc.communicate(timeout=600)
            assert proc.returncode == 0, (line, stderr[-3000:])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for i in range(len(others)):
        assert glob.glob(str(tmp_path / str(i) / "tb" / "events.out.tfevents.*")), others[i]


def _script(name: str) -> list[str]:
    """A console script as the user types it, from this interpreter's environment (else its module)."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(path):
        return [path]
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        module, _, attr = tomllib.load(f)["project"]["scripts"][name].partition(":")
    call = f"import sys; sys.argv[0] = {name!r}; from {module} import {attr}; {attr}()"
    return [sys.executable, "-c", call]


def test_getting_started_generate_and_export_work_on_the_main_jobs_workdir(main_job, tmp_path):
    """docs/getting-started.md's sample and export lines, on the run the main job left."""
    workdir, env, res = main_job
    assert res.returncode == 0, res.stderr[-3000:]
    guide = _read(os.path.join(DOCS, "getting-started.md"))
    generate = "jaxrl-generate --checkpoint runs/tiny_arith --prompt \"37+85=\" --max-new-tokens 6"
    export = "jaxrl-export-hf runs/tiny_arith --out /tmp/tiny_arith_hf"
    assert generate in guide and export in guide
    hf = str(tmp_path / "hf")
    procs = []  # the two side by side: each only reads the run
    for line in (generate, export):
        argv = shlex.split(line.replace("runs/tiny_arith", workdir).replace("/tmp/tiny_arith_hf", hf))
        procs.append(subprocess.Popen([*_script(argv[0]), *argv[1:]], cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    outputs = []
    try:
        for line, proc in zip((generate, export), procs, strict=True):
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, (line, stderr[-3000:])
            outputs.append(stdout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "ids:" in outputs[0], outputs[0][-2000:]
    assert os.path.exists(os.path.join(hf, "config.json")) and glob.glob(os.path.join(hf, "*.safetensors"))


def test_every_command_the_readme_names_exists_and_takes_its_flags():
    """Console scripts are the project's, launchers and configs exist, and the local-cluster flags the
    launcher table shows are the command's (its `--help`). The plan-check line runs verbatim in
    tests/test_plan_check.py; the TPU and SLURM launchers' dry runs in tests/test_launchers.py."""
    text = _read(README)
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        scripts = set(tomllib.load(f)["project"]["scripts"])
    named = set(re.findall(r"(?:`|^)(jaxrl-[a-z-]+)", text, re.MULTILINE))
    assert named and named <= scripts, named - scripts
    for path in set(re.findall(r"\b((?:launch|configs|benchmarks)/[\w./-]+\.(?:py|sh|sbatch))", text)):
        assert os.path.exists(os.path.join(REPO, path)), path
    for module in re.findall(r"python -m (benchmarks\.[a-z_]+)", text):
        assert os.path.exists(os.path.join(REPO, *module.split(".")) + ".py"), module
    assert re.search(r"^jaxrl-plan-check --config configs/math_8b.py:h100 ", text, re.MULTILINE)
    flags = set(re.findall(r"`jaxrl-local-cluster (--[a-z-]+)(?: N)?(?: (--[a-z-]+))?", text))
    flags = {f for pair in flags for f in pair if f}
    assert {"--num-processes", "--pin-cores", "--rehearse"} <= flags
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    res = subprocess.run([*_script("jaxrl-local-cluster"), "--help"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    for flag in flags:  # absl shows a boolean as --[no]name
        assert re.search(rf"^  --(\[no\])?{flag[2:]}:", res.stdout, re.MULTILINE), flag
