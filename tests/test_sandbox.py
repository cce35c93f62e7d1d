"""Code sandbox: hostile programs are contained within their limits and the reward pool stays healthy."""

import multiprocessing as mp
import os
import socket

import pytest

from jaxrl_async.rewards import RewardConfig, RewardService
from jaxrl_async.rewards import sandbox as sb
from jaxrl_async.rewards.hostile import BREACH_MARKER, CASES, SECRET_ENV, render

LIMITS = {"timeout_s": 2.0, "cpu_s": 2, "memory_mb": 256, "max_processes": 32, "max_output_bytes": 1 << 16}
SLACK_S = 3.0  # startup + kill + cleanup on 2 shared cores
# Isolation layer each case relies on beyond rlimits; without it the case is reported, not asserted.
NEEDS = {"fork bomb": "uid", "read parent's env secrets": "uid", "kill its parent": "uid"}
WORKERS = 3


@pytest.fixture(scope="module")
def sandbox_proc():
    """A spawned process to call the sandbox from: the test process may hold JAX threads, and forking
    (as subprocess does with preexec_fn) is unsafe there; reward workers are spawned the same way."""
    with mp.get_context("spawn").Pool(1) as pool:
        yield lambda fn, *args: pool.apply(fn, args)


@pytest.fixture(scope="module")
def caps(sandbox_proc):
    return sandbox_proc(sb.capabilities)


def _sandbox_uid_processes() -> list[int]:
    """Live (non-zombie) processes running under a sandbox uid."""
    out = []
    for entry in os.listdir("/proc"):
        info = sb._uid_and_state(entry) if entry.isdigit() else None
        if info and info[0] >= sb._UID_BASE and info[1] != "Z":
            out.append(int(entry))
    return out


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    """Runs every hostile case once, in parallel, through a RewardService with the code reward."""
    escape = tmp_path_factory.mktemp("outside") / "escaped.txt"
    secret = "s3cr3t-" + os.urandom(6).hex()
    os.environ[SECRET_ENV] = secret  # the workers inherit it; the sandboxed programs must not see it
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    cfg = RewardConfig(reward="code", num_workers=WORKERS, timeout_s=20.0, defaults={"sandbox": LIMITS})
    svc = RewardService(cfg)
    try:
        svc.wait_ready()
        items = [
            (
                case.name,
                render(case, escape_path=str(escape), secret=secret, port=port),
                {"tests": [{"input": "", "output": BREACH_MARKER}]},
            )
            for case in CASES
        ]
        results = svc.grade_batch_results(items, timeout=120)
        healthy = svc.grade_batch(
            [("p", "print(int(input()) * 2)", {"tests": [{"input": "21", "output": "42"}]})]
        )
        stats = svc.stats()
    finally:
        svc.close()
        listener.close()
        del os.environ[SECRET_ENV]
    return {
        "results": dict(zip([c.name for c in CASES], results, strict=True)),
        "healthy": healthy,
        "stats": stats,
        "escape": escape,
        "leftovers": _sandbox_uid_processes(),
    }


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_case_contained(hostile_run, caps, case):
    need = NEEDS.get(case.name)
    if need and not getattr(caps, need):
        pytest.skip(f"isolation layer {need!r} unavailable here: {caps.describe()}")
    res = hostile_run["results"][case.name]
    assert res.reason == "ok", res  # the reward function itself finished: the sandbox, not the pool, coped
    assert res.reward == 0.0, f"{case.name} escaped: {res.info}"
    status = res.info.split("first failure: ")[-1]
    assert status in case.expected, f"{case.name}: {res.info}"
    assert res.elapsed_s < LIMITS["timeout_s"] + SLACK_S, res


def test_pool_healthy_after_hostile_suite(hostile_run):
    assert hostile_run["healthy"] == [1.0]
    stats = hostile_run["stats"]
    assert stats["workers_alive"] == WORKERS and stats["worker_restarts"] == 0, stats
    assert not hostile_run["escape"].exists()
    assert not os.path.exists("/tmp/jaxrl_sandbox_escape.txt")
    assert hostile_run["leftovers"] == [], "sandboxed processes survived their run"


def test_run_python_stdin_stdout_and_exit_codes(sandbox_proc):
    run = lambda code, stdin: sandbox_proc(sb.run_python, code, stdin, sb.SandboxLimits(timeout_s=5.0))
    ok = run("print(sum(map(int, input().split())))", "3 4\n")
    assert (ok.status, ok.stdout, ok.returncode) == ("ok", "7\n", 0)
    bad = run("raise SystemExit(3)", "")
    assert (bad.status, bad.returncode) == ("exit_nonzero", 3)
    err = run("1/0", "")
    assert err.status == "exit_nonzero" and "ZeroDivisionError" in err.stderr


def test_output_is_capped_exactly(sandbox_proc):
    res = sandbox_proc(sb.run_python, "print('y' * 5000)", "", sb.SandboxLimits(max_output_bytes=1000))
    assert res.status == "output_limit" and len(res.stdout) == 1000


def test_environment_scrubbed_and_cwd_private(sandbox_proc):
    # The pool process was spawned before this variable existed; pass it to the program's parent via code.
    code = "import os; print(sorted(os.environ)); print(os.getcwd())"
    res = sandbox_proc(_run_with_env, code, "JAXRL_PARENT_ONLY")
    keys, cwd = res.stdout.splitlines()
    assert "JAXRL_PARENT_ONLY" not in keys
    assert set(eval(keys)) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONIOENCODING", "LC_CTYPE"}
    assert os.path.basename(cwd).startswith("jaxrl_sbx_") and not os.path.exists(cwd)  # removed afterwards


def _run_with_env(code: str, name: str) -> sb.SandboxResult:
    os.environ[name] = "1"
    return sb.run_python(code, "", sb.SandboxLimits())


def test_detached_child_is_killed_after_main_exits(sandbox_proc, caps):
    code = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(300)\n"
        "else:\n    print('main done')\n"
    )
    res = sandbox_proc(sb.run_python, code, "", sb.SandboxLimits(timeout_s=5.0))
    assert res.status == "ok" and res.stdout == "main done\n"
    if caps.uid:
        assert _sandbox_uid_processes() == []


def test_limits_validated():
    with pytest.raises(ValueError, match="timeout_s"):
        sb.SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="isolation"):
        sb.SandboxLimits(isolation="none")
