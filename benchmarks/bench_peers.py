"""Peers side by side: TRL's and Tunix's own GRPO loops beside ours (sync and async) on the same work.

  python -m benchmarks.bench_peers --venvs ~/.cache/jaxrl_async/peer_venvs --out runs/bench_peers --steps 150
  python -m benchmarks.bench_peers --venvs ... --smoke --peers trl,ours_sync  # a few steps: do drivers run?
  python -m benchmarks.bench_peers --report runs/bp_s0,runs/bp_s1,runs/bp_s2  # finished runs (seeds)
  for s in 0 1 2; do python -m benchmarks.bench_peers --venvs ... --out runs/bp_s$s --rotate=$s \
      --config.seed=$s --config.data.seed=$s; done  # seeds, each in its own framework order

1. Builds each selected peer's venv under --venvs (never inside the checkout), unless one built from the
   same requirements is there: TRL at the version pip serves with CPU torch; Tunix 0.1.7 in a venv of its
   own (it pins safetensors<0.8).
2. Exports the task of --config (default configs/tiny_arith.py; `--config.KEY=VALUE` overrides apply to
   every framework): our supervised warm start as a Hugging Face directory with a tokenizer.json of our
   ids (OUT/model), the train prompts in the order our run draws them (OUT/train.jsonl) and the held-out
   set (OUT/heldout.jsonl), and the GRPO settings every framework runs with (OUT/spec.json).
3. Checks that every framework's step-0 held-out greedy accuracy is equal (within --step0-tolerance)
   before anything trains; a difference stops the benchmark unless --no-require-step0-match.
4. Runs each framework's own loop, one at a time, pinned to --cores: the peers' drivers
   (benchmarks/peer_drivers/, copied to OUT/drivers and run with the peer's interpreter) and
   `jaxrl-run` with the config in sync mode and in async mode (--async-processes 2: the learner and the
   sampler in pinned processes of their own, as `jaxrl-local-cluster --pin-cores` runs them); the
   `_noskip` variants of ours train with `trainer.skip_zero_advantage=False`, every group as the peers'
   loops do. --rotate=K runs the list rotated by K places: give each seed its own, so no framework
   always runs first on a machine that warms up or last on one that a neighbour starts to load.
5. Writes OUT/bench_peers.json and prints a table: step-0 and final accuracy, seconds to the target
   accuracy (--target-accuracy; 0: ours_sync's final accuracy minus one point), trained tokens/s, steady
   seconds per step and each framework's whole process time (start to exit: loading, compilation and
   evaluations included).

Timing: a peer's driver blocks its loop to evaluate, so its clock leaves the evaluations out; ours
evaluate beside training, and an evaluation's time is when its version was trained, so neither counts
evaluations. Our clock starts with the learner (compilation included), a peer's after loading. The
patches a peer needed are listed in its result (Tunix: see peer_drivers/tunix_grpo.py).

--report reads finished runs' OUT/bench_peers.json back (one --out per seed) and prints them together at
--target-accuracy (0: each run's own target): every framework's time to the target per run, or the clock
at its last evaluation where it missed (a lower bound), its finals, steady seconds per step and trained
tokens/s over the runs, and each peer's time to the target over ours per run. It trains nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

from absl import app, flags
from ml_collections import config_flags

from benchmarks import peer_bench as pb
from jaxrl_async.cli import REPO, command_env, module_command, run_command

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(REPO, "configs", "tiny_arith.py"), "The task and GRPO settings (configs/*.py)."
)
_OUT = flags.DEFINE_string("out", "runs/bench_peers", "Directory for the export, the runs and the report.")
_VENVS = flags.DEFINE_string("venvs", None, "Directory for the peers' venvs (outside the checkout).")
_PEERS = flags.DEFINE_string("peers", ",".join(pb.FRAMEWORKS), f"Frameworks to run, of {pb.FRAMEWORKS}.")
_ROTATE = flags.DEFINE_integer("rotate", 0, "Run --peers' frameworks rotated left by this many places (a "
                               "seed loop passes its seed, so the order changes per seed).")
_STEPS = flags.DEFINE_integer("steps", 150, "Train steps per framework.")
_CORES = flags.DEFINE_list("cores", ["0"], "CPU cores every framework is pinned to (one at a time).")
_TARGET = flags.DEFINE_float("target-accuracy", 0.0, "Held-out accuracy to time; 0 = ours_sync final - 0.01.")
_TOL = flags.DEFINE_float("step0-tolerance", 0.0, "Allowed spread of the step-0 accuracies.")
_REQUIRE = flags.DEFINE_bool("require-step0-match", True, "Stop when the step-0 accuracies differ.")
_SMOKE = flags.DEFINE_bool("smoke", False, "3 steps of 8 prompts, 40 held-out (not --steps): drivers run?")
_ASYNC_PROCS = flags.DEFINE_integer(
    "async-processes", 1, "2: ours_async runs the learner and the sampler in processes of their own, each "
    "on its own block of --cores (jaxrl-local-cluster --pin-cores; needs 2 or more cores)."
)
_TIMEOUT = flags.DEFINE_float("timeout-s", 7200.0, "Seconds a framework's run may take.")
_REPORT = flags.DEFINE_list("report", [], "Finished runs' --out directories (seeds) to read back and print "
                            "together at --target-accuracy; trains nothing (--venvs not needed).")

_SMOKE_SET = {"total_steps": 3, "prompts_per_step": 8, "eval_every": 1, "eval_prompts": 40}


def _overrides() -> dict:
    """The bench's own config overrides (the smoke shape and the step count), applied in this process and
    given to our runs as --config.KEY=VALUE."""
    values = dict(_SMOKE_SET) if _SMOKE.value else {"total_steps": _STEPS.value}
    return values


def _user_overrides() -> list[str]:
    """The user's --config.KEY=VALUE overrides, passed on to our runs (the bench's own come after)."""
    values = config_flags.get_override_values(flags.FLAGS["config"])
    return [f"--config.{k}={v}" for k, v in values.items() if k not in _overrides()]



def _run_pinned(cmd: list[str], log_path: str, cores: tuple[int, ...], env=None) -> float:
    """Runs `cmd` on `cores`; returns its wall seconds, start to exit (loading and compilation included)."""
    # taskset, not a preexec_fn: this process runs JAX (threads), where fork-then-Python is unsafe.
    cmd = ["taskset", "-c", ",".join(map(str, cores)), *cmd]
    print(f"  $ {' '.join(cmd)}   (log {log_path})", flush=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=_TIMEOUT.value)
    rc = proc.returncode
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        took = time.monotonic() - t0
        raise RuntimeError(f"{' '.join(cmd[3:5])} exited {rc} after {took:.0f} s; log {log_path}:\n{tail}")
    return time.monotonic() - t0


def _prepare(out: str, steps: int):
    """The export, the prompt dump and the spec; returns (spec path, our step-0 accuracy)."""
    import jax

    from jaxrl_async.runtime import build

    run = build.validate(_CONFIG.value, num_devices=None)
    tokenizer = build.build_tokenizer(run)
    model_cfg = build.model_config(run, tokenizer)
    params, info = build.warm_started_params(run, model_cfg, tokenizer, jax.devices()[0], show=False)
    params = jax.device_put(params, jax.devices()[0])  # host arrays -> jax arrays, which save_hf writes
    model_dir = pb.export_model(model_cfg, params, tokenizer, out)
    paths = pb.dump_prompts(run, tokenizer, out, steps)
    spec = pb.make_spec(run, model_dir, paths, steps, tokenizer, threads=len(_CORES.value))
    spec_path = os.path.join(out, "spec.json")
    spec.write(spec_path)
    print(f"exported the warm start (held-out {info['accuracy']:.4f}) to {model_dir}; prompts and spec "
          f"in {out}", flush=True)  # fmt: skip
    return spec_path, info.get("accuracy")


def _our_command(name: str, workdir: str, user: list[str]) -> list[str]:
    values = [f"--config.{k}={v}" for k, v in _overrides().items()]
    path = config_flags.get_config_filename(flags.FLAGS["config"])
    run_flags = [f"--config={path}", *user, *values, *pb.our_mode_flags(name), f"--config.workdir={workdir}"]
    if name.startswith("ours_sync") or _ASYNC_PROCS.value == 1:
        return module_command("run", *run_flags)
    run_flags += ["--config.mesh.trainer_processes=(0,)", "--config.mesh.sampler_processes=(1,)"]
    return module_command("local_cluster", "--num-processes", "2", "--pin-cores", "--", *run_flags)


def _report(outs: list[str]) -> None:
    reps = []
    for out in outs:
        path = os.path.join(out, "bench_peers.json")
        if not os.path.exists(path):
            raise app.UsageError(f"--report: {path} does not exist (not a finished bench_peers --out)")
        with open(path) as f:
            reps.append(json.load(f))
        if "ours_sync" not in reps[-1]["results"] and not _TARGET.value:
            raise app.UsageError(f"--report: {path} has no ours_sync run to set its target; give "
                                 "--target-accuracy")  # fmt: skip
    summary = pb.seeds_summary(reps, _TARGET.value or None)
    for out, run in zip(outs, summary["runs"], strict=True):
        step0 = ", ".join(f"{k} {v:.4f}" for k, v in run["step0"].items() if v is not None)
        print(f"{out}: step-0 accuracy {step0}; target {run['target']:.4f}")
    print(pb.seeds_tables(summary, [os.path.basename(os.path.normpath(o)) for o in outs]))


def main(argv):
    del argv
    if _REPORT.value:
        return _report(_REPORT.value)
    if not _VENVS.value:
        raise app.UsageError("--venvs: required to run the benchmark (a directory outside the checkout)")
    frameworks = pb.parse_frameworks(_PEERS.value, _ROTATE.value)
    print(f"frameworks, in the order they train: {', '.join(frameworks)}", flush=True)
    venvs = os.path.abspath(os.path.expanduser(_VENVS.value))
    if os.path.commonpath([venvs, REPO]) == REPO:
        raise app.UsageError(f"--venvs: {venvs} is inside the checkout {REPO}; give a directory outside it")
    cores = tuple(int(c) for c in _CORES.value)
    allowed = sorted(os.sched_getaffinity(0))
    if not set(cores) <= set(allowed):
        raise app.UsageError(f"--cores: {list(cores)} not all in this process's {allowed}")
    if _ASYNC_PROCS.value not in (1, 2) or (_ASYNC_PROCS.value == 2 and len(cores) < 2):
        raise app.UsageError(f"--async-processes: 1, or 2 with two or more --cores; got "
                             f"{_ASYNC_PROCS.value} with --cores {list(cores)}")  # fmt: skip
    out = os.path.abspath(_OUT.value)
    os.makedirs(out, exist_ok=True)
    for k, v in _overrides().items():
        setattr(_CONFIG.value, k, v)
    steps = _CONFIG.value.total_steps
    pythons = {p: pb.ensure_venv(venvs, p, os.path.join(out, f"{p}_venv.log")) for p in frameworks
               if p in pb.PEERS}  # fmt: skip
    spec_path, ours0 = _prepare(out, steps)

    step0 = {"ours": ours0}
    for peer, python in pythons.items():
        result = os.path.join(out, f"{peer}_step0.json")
        cmd = pb.driver_command(python, peer, out, spec_path, result, step0=True)
        _run_pinned(cmd, os.path.join(out, f"{peer}_step0.log"), cores)
        step0[peer] = pb.step0(pb.read_peer(result))
    ok, message = pb.step0_check(step0, _TOL.value)
    print(message, flush=True)
    if not ok and _REQUIRE.value:
        raise SystemExit(f"{message}: the frameworks do not start from the same policy; nothing trained")

    results = {}
    user = _user_overrides()
    for name in frameworks:
        if name in pb.STEP0_ONLY:
            print(f"{name}: not trained: {pb.STEP0_ONLY[name]}", flush=True)
            continue
        print(f"{name}: {steps} steps", flush=True)
        if name in pb.OURS:
            workdir = os.path.join(out, name)
            cmd = _our_command(name, workdir, user)
            took = _run_pinned(cmd, workdir + ".log", cores, env=command_env(force_cpu=True))
            results[name] = {**pb.read_ours(workdir, name), "process_s": took}
        else:
            result = os.path.join(out, f"{name}.json")
            cmd = pb.driver_command(pythons[name], name, out, spec_path, result, step0=False)
            took = _run_pinned(cmd, os.path.join(out, f"{name}.log"), cores)
            results[name] = {**pb.read_peer(result), "process_s": took}
    target = _TARGET.value or None  # None: no target (no --target-accuracy and no ours_sync run)
    if target is None and "ours_sync" in results:
        target = results["ours_sync"]["evals"][-1]["accuracy"] - 0.01
    rep = {**pb.report(results, target), "step0": {"ok": ok, "message": message, "accuracies": step0},
           "steps": steps, "cores": list(cores), "smoke": _SMOKE.value, "overrides": user,
           "order": frameworks, "not_trained": {k: v for k, v in pb.STEP0_ONLY.items() if k in frameworks},
           "results": results}  # fmt: skip
    with open(os.path.join(out, "bench_peers.json"), "w") as f:
        json.dump(rep, f, indent=1, default=str)
    print(message)
    for name, why in rep["not_trained"].items():
        print(f"{name}: not trained: {why}")
    print(pb.table(rep))


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":
    run()
