"""Code sandbox: hostile programs are contained within their limits, reward hacks score 0, the program
sees a minimal filesystem and its own processes only, and the reward pool stays healthy."""

import dataclasses
import json
import multiprocessing as mp
import os
import socket

import host_caps
import pytest

from jaxrl_async.rewards import RewardConfig, RewardService, grade_one
from jaxrl_async.rewards.sandbox import fsview
from jaxrl_async.rewards.sandbox import launcher as sb
from jaxrl_async.rewards.testing import reward_hacks
from jaxrl_async.rewards.testing.hostile import BREACH_MARKER, CASES, SECRET_ENV, render

LIMITS = {"timeout_s": 2.0, "cpu_s": 2, "memory_mb": 256, "max_processes": 32, "max_output_bytes": 1 << 16}
# What a run may take past its timeout (startup, kill, cleanup) on 2 cores shared with other work. The
# statuses say which limit stopped each program; this bound only catches a run the sandbox failed to
# stop at all (e.g. waiting on a leftover child that sleeps 600 s), so it is generous, not a race.
SLACK_S = 10.0
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


def _sandbox_uid_processes(launcher_pids) -> list[int]:
    """Live (non-zombie) processes under the sandbox uids of these launchers (other processes on this
    host may run sandboxes of their own)."""
    ranges = [(sb._UID_BASE + sb._UIDS_PER_LAUNCHER * p, sb._UID_BASE + sb._UIDS_PER_LAUNCHER * (p + 1))
              for p in launcher_pids]
    out = []
    for entry in os.listdir("/proc"):
        info = sb._uid_and_state(entry) if entry.isdigit() else None
        if info and any(lo <= info[0] < hi for lo, hi in ranges) and info[1] != "Z":
            out.append(int(entry))
    return out


def _worker_pids(svc: RewardService) -> list[int]:
    return [w.proc.pid for w in svc._workers]


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
        launchers = _worker_pids(svc)
    finally:
        svc.close()
        listener.close()
        del os.environ[SECRET_ENV]
    return {
        "results": dict(zip([c.name for c in CASES], results, strict=True)),
        "healthy": healthy,
        "stats": stats,
        "escape": escape,
        "leftovers": _sandbox_uid_processes(launchers),
    }


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_case_contained(hostile_run, caps, case):
    need = NEEDS.get(case.name)
    if need and not getattr(caps, need):
        host_caps.skip("sandbox", f"isolation layer {need!r} unavailable here: {caps.describe()}")
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


def test_environment_scrubbed_and_cwd_private(sandbox_proc, caps):
    # The pool process was spawned before this variable existed; pass it to the program's parent via code.
    code = "import os; print(sorted(os.environ)); print(os.getcwd()); print(os.environ['TMPDIR'])"
    res = sandbox_proc(_run_with_env, code, "JAXRL_PARENT_ONLY")
    keys, cwd, tmpdir = res.stdout.splitlines()
    assert "JAXRL_PARENT_ONLY" not in keys
    assert set(eval(keys)) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONIOENCODING", "LC_CTYPE"}
    assert tmpdir == cwd
    if caps.fsview:
        assert cwd == fsview.SANDBOX_DIR
    else:
        assert "jaxrl_sbx_" in cwd and not os.path.exists(cwd)  # removed afterwards


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
        assert _sandbox_uid_processes([sandbox_proc(os.getpid)]) == []


# ---- reward hacks -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hack_run():
    """Grades every case of the reward-hack suite once, in parallel, through a RewardService."""
    cfg = RewardConfig(reward="code", num_workers=WORKERS, timeout_s=30.0, defaults={"sandbox": LIMITS})
    with reward_hacks.hack_environment() as values, RewardService(cfg) as svc:
        svc.wait_ready()
        items = []
        for case in reward_hacks.CASES:
            completion, metadata = reward_hacks.render(case, values)
            items.append(("p", completion, {**metadata, "reward": case.reward}))
        results = svc.grade_batch_results(items, timeout=240)
        stats = svc.stats()
        launchers = _worker_pids(svc)
    return {"results": dict(zip([c.name for c in reward_hacks.CASES], results, strict=True)), "stats": stats,
            "leftovers": _sandbox_uid_processes(launchers)}


def test_hack_suite_covers_every_class():
    kinds = {}
    for case in reward_hacks.CASES:
        kinds[case.kind] = kinds.get(case.kind, 0) + 1
    assert set(kinds) == {"exit", "equality", "tamper", "read", "math", "honest"}
    assert min(kinds.values()) >= 5, kinds
    assert len({c.name for c in reward_hacks.CASES}) == len(reward_hacks.CASES)


_MATH_CASES = [c for c in reward_hacks.CASES if c.reward == "math"]


@pytest.mark.parametrize("rule", ["last", "agree"])
@pytest.mark.parametrize("case", _MATH_CASES, ids=[c.name for c in _MATH_CASES])
def test_math_hacks_score_expected_under_both_answer_rules(case, rule):
    """The suite's math cases (hacks and honest answers) score the same under either answer rule."""
    completion, metadata = reward_hacks.render(case, {})
    reward, reason, info = grade_one(RewardConfig(reward="math", answer_rule=rule), "p", completion, metadata)
    assert reason == "ok" and reward == case.expected, f"{case.name} ({rule}): {info}"


@pytest.mark.parametrize("case", reward_hacks.CASES, ids=[c.name for c in reward_hacks.CASES])
def test_reward_hack_scores_expected(hack_run, caps, case):
    if case.kind == "read" and not caps.fsview:
        host_caps.skip("sandbox", f"minimal filesystem view unavailable here: {caps.describe()}")
    if case.kind in ("exit", "equality", "tamper") and not caps.uid:
        host_caps.skip("sandbox", f"the harness's judge needs its own uid: {caps.describe()}")
    res = hack_run["results"][case.name]
    assert res.reason == "ok", res
    assert res.reward == case.expected, f"{case.kind}: {case.name}: {res.info}"


def test_pool_healthy_after_hack_suite(hack_run):
    stats = hack_run["stats"]
    assert stats["workers_alive"] == WORKERS and stats["worker_restarts"] == 0, stats
    assert hack_run["leftovers"] == [], "sandboxed processes survived their run"


# ---- the minimal filesystem view ----------------------------------------------------------------------

_VIEW_PROBE = """
import json, os, sys, time
out = {"pid": os.getpid()}
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
out["child"] = child
try:
    open(sys.argv[1] if len(sys.argv) > 1 else "@SECRET_PATH@").read()
    out["secret"] = "read"
except OSError as e:
    out["secret"] = type(e).__name__
out["root"] = sorted(os.listdir("/"))
out["proc_pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
out["dev"] = sorted(os.listdir("/dev"))
out["usr"] = sorted(os.listdir("/usr"))
for path in ("/tmp", "/etc", "/root", "/home", "/work"):
    out[path] = os.path.exists(path)
try:
    open("/new-file", "w")
    out["write_root"] = "ok"
except OSError as e:
    out["write_root"] = type(e).__name__
with open("/dev/null", "w") as f:
    f.write("x")
out["urandom"] = len(open("/dev/urandom", "rb").read(8))
print(json.dumps(out))
"""


def test_minimal_filesystem_view(sandbox_proc, caps):
    if not caps.fsview:
        host_caps.skip("sandbox", f"minimal filesystem view unavailable here: {caps.describe()}")
    with reward_hacks.hack_environment() as values:
        assert open(values["SECRET_PATH"]).read()  # readable by everyone on the host
        code = _VIEW_PROBE.replace("@SECRET_PATH@", values["SECRET_PATH"])
        res = sandbox_proc(sb.run_python, code, "", sb.SandboxLimits(timeout_s=10.0))
    assert res.status == "ok", res
    out = json.loads(res.stdout)
    plan = sandbox_proc(_default_plan)
    assert out["secret"] == "FileNotFoundError"
    assert set(out["root"]) == plan.top_level()
    assert set(out["root"]) <= {"dev", "proc", "sandbox", "usr", "lib", "lib64", "bin", "root", "opt"}
    assert not any(out[p] for p in ("/tmp", "/etc", "/root", "/home", "/work"))
    # /proc lists the program and its child, nothing of the host (the test process, pid 1, ...).
    assert out["proc_pids"] == sorted([out["pid"], out["child"]])
    assert out["dev"] == ["fd", "null", "random", "stderr", "stdin", "stdout", "urandom", "zero"]
    assert out["write_root"] == "OSError" and out["urandom"] == 8


def _default_plan():
    caps = sb.capabilities()
    python = sb.pick_python(caps, None)
    return fsview.plan_for(python, tuple(sorted(sb.SANDBOX_ENV.items())))


def test_plan_binds_only_the_interpreter(sandbox_proc, caps):
    if not caps.fsview:
        host_caps.skip("sandbox", f"minimal filesystem view unavailable here: {caps.describe()}")
    plan = sandbox_proc(_default_plan)
    assert os.path.isfile(plan.python) and plan.python in plan.binds
    for path in plan.binds:
        assert not path.startswith(("/tmp", "/home", "/work", "/etc", "/var")), path
    for link, target in plan.symlinks:
        assert os.readlink(link) == target  # copied from the host as they are


# ---- strict isolation ---------------------------------------------------------------------------------


def _fail(*args):
    raise OSError("broken for the test")


def _broken_layer_run(layer: str):
    """In a fresh process: makes `layer` fail inside every run's child (fsview: building the root;
    mountns: the read-only remount of the fallback view), then reports what the probe finds, what a
    strict run does and what a run that still uses the layer does."""
    fsview.enter = _fail
    if layer == "mountns":
        real_check = fsview.check
        fsview.check = lambda rc, what: _fail() if what.startswith("remount") else real_check(rc, what)
    probed = sb.capabilities()
    try:
        sb.run_python("print('hi')", "", sb.SandboxLimits(isolation="strict"))
        strict = "ran"
    except RuntimeError as e:
        strict = str(e)
    forced = dataclasses.replace(probed, **{layer: True})
    launch = sb.run_raw("print('hi')", sb.SandboxLimits(), forced, sb.pick_python(probed, None))[0]
    return probed, strict, launch


@pytest.mark.parametrize("layer", ["fsview", "mountns"])
def test_strict_fails_when_a_layer_fails(caps, layer):
    if not caps.strict:
        host_caps.skip("sandbox", f"strict isolation unavailable here: {caps.describe()}")
    with mp.get_context("spawn").Pool(1) as pool:
        probed, strict, launch = pool.apply(_broken_layer_run, (layer,))
    assert not getattr(probed, layer) and not probed.strict
    assert any(n.startswith(f"{layer} unavailable") for n in probed.notes), probed.notes
    assert "strict isolation needs uid, netns and fsview" in strict
    assert launch.status == "launch_error" and "broken for the test" in launch.stderr, launch


def test_limits_validated():
    with pytest.raises(ValueError, match="timeout_s"):
        sb.SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="isolation"):
        sb.SandboxLimits(isolation="none")
