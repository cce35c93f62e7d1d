"""Wall time to a held-out accuracy, sync vs async, on a learnable long-tailed task (configs/letter_range.py).

  python -m benchmarks.bench_learning --seeds 0,1,2 --steps 150 --out /tmp/bench_learning.json
  python -m benchmarks.bench_learning --smoke   # a few tiny steps: proves the command works (a test runs it)

Every run is `jaxrl-run` (or `jaxrl-local-cluster`) in a process of its own from the same cached supervised
warm start (one per seed: seed s sets `config.seed` and `config.data.seed`, so both modes of a seed share
the warm start, the data order and the sampling keys); its summary.json is read back. The runs, per seed:
  sync   one process on every core: sample a batch to its last token, then train it (η = 0);
  async  (--async-processes 2, the default) the learner on process 0 and the sampler on process 1, each
         pinned to a core of its own (jaxrl-local-cluster --pin-cores), η = --η; with 1, one process.
         --async-cpu-sets names the two processes' cores instead (jaxrl-local-cluster --cpu-sets): 0,1:1
         lets the learner use both cores and so the time the sampler leaves idle on core 1.
Before the runs, the roles are timed alone (benchmarks.bench_roles, on every core and on one core with the
decode curve) and the performance model predicts the async / sync throughput ratio: the shared-host
model for sync and one-process async, the split model (calibrated, lognormal lengths with the task's own
reference-answer median and p99) for the pinned two-process run (jaxrl_async.perf.shared_host's
predict_lent_core when --async-cpu-sets puts the learner on every core and the sampler on one of them;
then the two roles are also timed side by side in that layout, benchmarks.bench_roles --corun, since each
slows the other on the core they share), and the split model's best split of a 16-core host within η,
at any η (with the η that one needs) and at each η up to that one (with the splits within 5% of each).
The prediction is printed before any run starts and again beside the measurement, with a second one
after the runs: the same model given what the runs realized (each mode's own mean train step, the async
runs' own completion lengths). The role benches time the warm start's batches, and the trainer's work
shrinks as the policy learns (groups all right or all wrong are skipped), so the two tell the model's
error from the workload's drift.

With --compile-cache=warm (the default) every run shares a compile cache (config.compile_cache_dir) that
one untimed run of each mode (WARM_UP_STEPS steps) fills first, as a user's later runs find theirs; so
start-up is mostly the first evaluation and batch. JAX writes entries from process 0 only, so the async
sampler's own process keeps its engines' executables in the cache's `executables/` (its log says how many
it loaded); each run reports how many of the learner process's compiles the cache gave.
--compile-cache=cold compiles everything in every run.

Reported per mode (means over seeds) and per seed: wall seconds to the target (the first held-out
evaluation at or above it, seconds since the learner started; default target: sync's final accuracy,
mean of seeds, minus --margin), the same from the end of the run's first step (start-up left out, as a
long run's is), the step it happened, final accuracy, late accuracy (the mean of the last 3
evaluations: one evaluation swings by points between steps), steady trained tokens/s, sampler and trainer
idle fractions, realized staleness (mean, max), and p99/median of the run's own completion
lengths. The paired speedup (sync time / async time) splits into a throughput ratio times a steps ratio;
each paired figure has its mean and 95% t interval over seeds. The same ratios follow against each seed's
own target (its sync run's final accuracy minus --margin): a common target leaves out the seeds whose
sync run ends below it, while every seed's sync run reaches its own.
With --report DIR[,DIR...] nothing runs: the runs that --keep DIR left are read back (several directories'
seeds pooled) and reported again, against another --target or --margin say. Where a directory holds its role
benches, its prediction is made again from them, beside its own seeds' measurement (each directory's benches
are its own): η, the async layout and the batch shape come from the settings.json that the run wrote there;
in a directory from before that file, η and the process count from the async runs' summaries, the lent core
from the co-run benches (timed only in that layout), the batch shape from --config and --set. Directories
whose runs had different η do not pool. With --workload-from DIR[,DIR...] the prediction is also made with
the mean train steps and completion lengths that earlier runs of the task realized (the runs --keep left
there): inputs that exist before the runs, which the warm start's role benches cannot see.
With --one-core, sync of the first seed also runs on one core: every-core over one-core steady rate is
how well sync uses the cores, and the core count over that is the most overlap alone can buy (two roles
at one core each make at most twice the one-core rate; benchmarks.learning_study.overlap_bound).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import tempfile
import time

import numpy as np
from absl import app, flags

from benchmarks import learning_slots
from benchmarks import learning_study as ls
from benchmarks import time_to_target as ttt
from jaxrl_async.cli import REPO, module_command, run_command, run_logged, spawn_logged, wait_logged

# REPO: the checkout (configs/ is not part of the installed package).
_CONFIG = flags.DEFINE_string("config", os.path.join(REPO, "configs", "letter_range.py"), "The run config.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds; each runs sync and async (>= 3 for a claim).")
_STEPS = flags.DEFINE_integer("steps", 150, "Train steps of every run.", lower_bound=1)
_MAX_STALENESS = flags.DEFINE_integer("max-staleness", 2, "Staleness bound of the async runs.", lower_bound=1)
_PROCS = flags.DEFINE_integer("async-processes", 2, "2: async roles pinned in processes of their own.", 1, 2)
_CPU_SETS = flags.DEFINE_string(
    "async-cpu-sets", "", "Two processes: learner:sampler cores (e.g. 0,1:1); default a core each."
)
_TARGET = flags.DEFINE_float("target", None, "Target held-out accuracy (default: sync final - margin).")
_MARGIN = flags.DEFINE_float("margin", 0.01, "Default target: sync's mean final accuracy minus this.")
_CURVE_FRAC = flags.DEFINE_float(
    "curve-target-frac", 0.5, "Seed-averaged time to target (benchmarks.time_to_target): the target as this "
    "fraction of sync's averaged way from its start to its end.", lower_bound=0.01, upper_bound=0.99)
_PREDICT = flags.DEFINE_bool("predict", True, "Time the roles alone first and predict the throughput ratio.")
_ONE_CORE = flags.DEFINE_bool(
    "one-core", False, "Also run sync on one core (first seed): the bound on what overlap alone buys."
)
_SET = flags.DEFINE_multi_string("set", [], "KEY=VALUE config override for every run (repeatable).")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny runs (4 steps, small batches, 1 seed unless --seeds).")
_KEEP = flags.DEFINE_string("keep", "", "Keep workdirs and logs here (default: a temporary directory).")
_OUT = flags.DEFINE_string("out", "", "Also write the JSON report here.")
_REPORT = flags.DEFINE_list(
    "report", [], "Nothing runs: report the runs that earlier --keep runs left in these directories (their "
    "sync_s<seed> and async_s<seed> workdirs, pooled; --seeds, if given, picks seeds), with this --target "
    "or --margin."
)  # fmt: skip
_EARLIER = flags.DEFINE_list(
    "workload-from", [], "Also predict with the mean train steps and completion lengths that earlier runs of "
    "the task realized (the runs that --keep left in these directories), in place of the warm start's: "
    "inputs that exist before this command's runs, which the role benches alone cannot see."
)  # fmt: skip
_SLOTS = flags.DEFINE_list(
    "slot-sweep", [], "sampler.num_slots values: each mode is first probed at each (a --sweep-steps run of "
    "the first seed, no evaluation) and its runs use its best; empty: the config's (or --set's) for both."
)
_SWEEP_STEPS = flags.DEFINE_integer("sweep-steps", 20, "Train steps of each --slot-sweep probe.",
                                    lower_bound=5)
_CACHE = flags.DEFINE_enum(
    "compile-cache", "warm", ["warm", "cold"],
    "warm: the runs share a compile cache (config.compile_cache_dir) that a short untimed run of each mode "
    "fills first, as a user's later runs find theirs; cold: every run compiles everything.",
)  # fmt: skip

# --smoke: every size a few, so the whole command (role benches, warm starts, both modes) takes minutes.
SMOKE = {
    "prompts_per_step": 4, "samples_per_prompt": 2, "eval_every": 0, "eval_prompts": 8, "eval_slots": 8,
    "text_samples": 0, "checkpoint_every": 0, "checkpoint_minutes": 0.0, "sampler.num_slots": 8,
    "warm_start.max_steps": 2, "warm_start.batch": 8, "warm_start.eval_every": 1,
}  # fmt: skip
SMOKE_STEPS = 4
WARM_UP_STEPS = 2  # the untimed run of each mode that fills the compile cache (--compile-cache=warm)
SETTINGS = "settings.json"  # in the runs' directory: what --report needs to predict again (η, layout, batch)
ROLE_BENCHES = {"every": "roles_every_core.json", "one": "roles_one_core.json"}  # time_roles' outputs
CORUN_BENCHES = {"trainer": "corun_trainer.json", "sampler": "corun_sampler.json"}  # corun_roles' outputs


def _overrides(root: str) -> dict[str, str]:
    """Config overrides of every run: the compile cache (--compile-cache=warm), --smoke's sizes, then --set
    (which wins)."""
    values: dict[str, str] = {}
    if _CACHE.value == "warm":
        values["compile_cache_dir"] = os.path.join(root, "compile_cache")
    if _SMOKE.value:
        values.update({k: str(v) for k, v in SMOKE.items()})
        values["warm_start.cache_dir"] = os.path.join(root, "warmstart")
    for kv in _SET.value:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise app.UsageError(f"--set: {kv!r} is not KEY=VALUE")
        values[key] = value
    return values


def run_flags(workdir: str, mode: str, seed: int, steps: int, overrides: dict[str, str]) -> list[str]:
    values = {"workdir": workdir, "mode": mode, "seed": seed, "data.seed": seed, "total_steps": steps,
              "max_staleness": _MAX_STALENESS.value, **overrides}  # fmt: skip
    return [f"--config={_CONFIG.value}", *(f"--config.{k}={v}" for k, v in values.items())]


def run_one(mode: str, seed: int, root: str, steps: int, overrides: dict[str, str],
            cores: list[int] | None = None, name: str = "") -> dict:  # fmt: skip
    name = name or f"{mode}_s{seed}" + (f"_cores{len(cores)}" if cores else "")
    workdir, log = os.path.join(root, name), os.path.join(root, f"{name}.log")
    flags_ = run_flags(workdir, mode, seed, steps, overrides)
    if mode == "async" and _PROCS.value == 2:
        flags_ += ["--config.mesh.trainer_processes=(0,)", "--config.mesh.sampler_processes=(1,)"]
        cores_ = [f"--cpu-sets={_CPU_SETS.value}"] if _CPU_SETS.value else ["--pin-cores"]
        cmd = module_command("local_cluster", "--num-processes", "2", *cores_, "--", *flags_)
    else:
        cmd = module_command("run", *flags_)
    run_logged(cmd, cores, log)
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def _data_and_tokenizer(overrides: dict[str, str]):
    """The runs' DataConfig (the config file's, with the data.* overrides) and their char tokenizer."""
    from jaxrl_async.data import DataConfig
    from jaxrl_async.tokenizer import CharTokenizer

    c = _base_config()
    data = dict(c.data)
    for k, v in overrides.items():
        if k.startswith("data."):
            try:
                data[k[5:]] = ast.literal_eval(v)
            except (ValueError, SyntaxError):
                data[k[5:]] = v
    if c.tokenizer != "char":
        raise app.UsageError(f"--config: the task figures need config.tokenizer='char', got {c.tokenizer!r}")
    return DataConfig(**data), CharTokenizer()


def reference_lengths(overrides: dict[str, str], n: int = 2000) -> dict[str, float]:
    """Median, p99 and max of the task's reference completions in tokens (stop token included): the
    length mix the prediction assumes, measured from the task itself (no model)."""
    from jaxrl_async.data import make_prompt_iterator, reference_completion

    data, tok = _data_and_tokenizer(overrides)
    it = make_prompt_iterator(data, tok)
    lengths = [len(tok.encode(reference_completion(next(it).text))) + 1 for _ in range(n)]
    p50, p99 = np.percentile(lengths, [50, 99])
    return {"median": float(p50), "p99": float(p99), "max": int(max(lengths))}


def eval_resolution(overrides: dict[str, str]) -> dict:
    """The held-out set the runs evaluate (its size) and its heaviest prompt's share of the weight: the
    most one prompt answered differently moves the accuracy, so gaps between runs below it may be one
    prompt (letter_range: a one-letter range, 0.032 at the default span power)."""
    from jaxrl_async.data import held_out_prompts

    data, tok = _data_and_tokenizer(overrides)
    n = _config_int("eval_prompts", overrides)
    weights = np.asarray([p.weight for p in held_out_prompts(data, tok, n)], np.float64)
    heaviest = float(weights.max() / weights.sum()) if len(weights) else 0.0
    return {"prompts": len(weights), "heaviest": heaviest}


def time_roles(root: str, overrides: dict[str, str]) -> dict[str, dict]:
    """Times the roles alone (seed 0's warm start, cached for the runs), on every core and on one:
    {"every": role bench, "one": role bench with its decode curve}."""
    seed = int(_SEEDS.value[0])
    benches = {}
    for name, cores in (("every", None), ("one", sorted(os.sched_getaffinity(0))[:1])):
        out = os.path.join(root, ROLE_BENCHES[name])
        work = out.removesuffix(".json")
        flags_ = run_flags(work, "async", seed, _STEPS.value, overrides)
        batches = "2" if _SMOKE.value else "6"
        cmd = module_command("benchmarks.bench_roles", *flags_, "--batches", batches, "--out", out)
        run_logged([*cmd, *(["--decode_curve"] if cores else [])], cores, work + ".log")
        with open(out) as f:
            benches[name] = json.load(f)
    return benches


def _base_config():
    from jaxrl_async.cli.config_file import sibling

    path = _CONFIG.value
    return sibling(path, os.path.splitext(os.path.basename(path))[0]).get_config()


def _config_int(key: str, overrides: dict[str, str]) -> int:
    """A top-level integer field of the runs' config: its override, else the config file's value."""
    return int(overrides[key]) if key in overrides else int(getattr(_base_config(), key))


def _lent_core() -> tuple[list[int], list[int]] | None:
    """(learner cores, sampler cores) when --async-cpu-sets lends the sampler's core to the learner: the
    learner (process 0) on every core, the sampler on one of them, the layout the split model has a form
    for; else None. Refuses a bad value before the role benches and the runs, not minutes into them."""
    if not _CPU_SETS.value:
        return None
    if _PROCS.value != 2:
        raise app.UsageError("--async-cpu-sets: the two async processes' cores; needs --async-processes 2")
    from jaxrl_async.cli.local_cluster import parse_cpu_sets

    cores = sorted(os.sched_getaffinity(0))
    try:
        learner, sampler = parse_cpu_sets(_CPU_SETS.value, 2, cores)
    except ValueError as e:
        raise app.UsageError(f"--async-cpu-sets={_CPU_SETS.value}: {e}") from None
    return (learner, sampler) if learner == cores and len(sampler) == 1 else None


def run_line(summary: dict) -> str:
    """When a run's first step ended, and what the compile cache gave the learner's process and the
    sampler's own (async)."""
    first, cache = summary.get("first_step_s"), summary.get("compile_cache")
    line = "no step" if first is None else f"first step done at {first:.1f} s"
    if cache:
        line += f"; the learner's process loaded {cache['loaded']} of its {cache['compiles']} compiles"
    for x in (summary.get("sampler_executables") or {}).values():
        line += f", the sampler's {x['loaded']} of its {x['loaded'] + x['compiled']} programs"
    return line


def shared_line(predicted: dict, benches: dict) -> str:
    """What the co-run benches measured of the lent layout, and the prediction without them."""
    a = predicted["async"]
    shared_s, shared_t = a["shared_paces_s"]
    alone_s = benches["one"]["sample_stream_s"]
    one, every = benches["one"]["train_step_s"], benches["every"]["train_step_s"]
    bound = a["tokens_per_s_without_corun"] / predicted["sync"]["tokens_per_s"]
    return (f"co-run: the sampler {shared_s:.3f} s a batch beside the learner ({alone_s:.3f} alone), the "
            f"learner {shared_t:.3f} s a step beside the sampler ({one:.3f} on one core alone, {every:.3f} "
            f"on every core); without the co-run the form gives {bound:.2f}")  # fmt: skip


def corun_roles(root: str, overrides: dict[str, str], lent: tuple[list[int], list[int]]) -> dict[str, dict]:
    """Times each role while the other runs beside it in the lent layout (benchmarks.bench_roles --corun, the
    learner's process on `lent[0]`, the sampler's on `lent[1]`): {"sampler": ..., "trainer": ...}."""
    meet = os.path.join(root, "corun")
    os.makedirs(meet, exist_ok=True)
    seconds = "2" if _SMOKE.value else "12"
    procs = {}
    for role, cores in zip(CORUN_BENCHES, lent, strict=True):
        work = os.path.join(root, CORUN_BENCHES[role]).removesuffix(".json")
        flags_ = run_flags(work, "async", int(_SEEDS.value[0]), _STEPS.value, overrides)
        cmd = module_command("benchmarks.bench_roles", *flags_, f"--corun={role}", f"--corun_dir={meet}",
                             f"--corun_seconds={seconds}", f"--out={work}.json")  # fmt: skip
        procs[role] = (spawn_logged(cmd, cores, work + ".log"), work)
    try:
        while any(p.poll() is None for p, _ in procs.values()):
            if any(p.poll() not in (None, 0) for p, _ in procs.values()):
                break  # one failed: its partner would wait for it until its timeout
            time.sleep(0.2)
        for proc, work in procs.values():
            if proc.poll() not in (None, 0):
                wait_logged(proc, work + ".log")  # raises with the failed one's log
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    out = {}
    for role, (_, work) in procs.items():
        with open(work + ".json") as f:
            out[role] = json.load(f)
    return out


def kept_runs(roots: list[str], pick: set[int] | None = None, flag: str = "--report") -> tuple[
        dict[str, dict[int, dict]], tuple[int, dict] | None, dict[str, list[int]]]:  # fmt: skip
    """The summaries of the runs that --keep directories hold ({mode: {seed: summary}}, pooled; only the
    seeds in `pick` unless None), a --one-core run's (seed, summary) (None if none), and each directory's
    seeds. Refuses a directory without both modes' runs, a seed that two directories hold, and directories
    whose async runs had different η (their summaries' max_staleness), naming them and `flag`."""
    summaries: dict[str, dict[int, dict]] = {m: {} for m in ls.MODES}
    where: dict[tuple[str, int], str] = {}
    max_staleness_values: dict[str, set[int]] = {}
    one_core = None
    for root in roots:
        found = {m: 0 for m in ls.MODES}
        for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            path = os.path.join(root, name, "summary.json")
            run = re.fullmatch(r"(sync|async)_s(\d+)(_cores\d+)?", name)
            if not run or not os.path.exists(path):
                continue
            mode, seed = run[1], int(run[2])
            found[mode] += not run[3]
            if pick is not None and seed not in pick:
                continue
            with open(path) as f:
                summary = json.load(f)
            if run[3]:
                one_core = one_core or (seed, summary)
                continue
            if (mode, seed) in where:
                other = where[mode, seed]
                raise app.UsageError(f"{flag}: {mode} seed {seed} is in both {other} and {root}")
            summaries[mode][seed], where[mode, seed] = summary, root
            if mode == "async" and summary.get("max_staleness") is not None:
                max_staleness_values.setdefault(root, set()).add(summary["max_staleness"])
        if not all(found.values()):
            raise app.UsageError(f"{flag}={root}: no sync_s<seed>/summary.json and async_s<seed>/"
                                 "summary.json there (the runs of bench_learning --keep)")  # fmt: skip
    if not all(summaries.values()):
        raise app.UsageError(f"{flag}: no run of --seeds={','.join(_SEEDS.value)} in both modes")
    if len(set().union(*max_staleness_values.values())) > 1:
        ran = "; ".join(f"{root}: η = {', '.join(map(str, sorted(e)))}" for root,
                        e in max_staleness_values.items())
        raise app.UsageError(f"{flag}: the async runs had different staleness bounds ({ran}); they do not "
                             "pool")  # fmt: skip
    seeds_of = {root: sorted(s for (m, s), r in where.items() if r == root and m == "sync") for root in roots}
    return summaries, one_core, seeds_of


def _setup(overrides: dict[str, str], lent_core: bool) -> ls.Setup:
    """What the split model needs of the runs, from this command's flags and the runs' config."""
    return ls.Setup(_MAX_STALENESS.value, _PROCS.value, _config_int("prompts_per_step", overrides),
                    _config_int("samples_per_prompt", overrides), lent_core)  # fmt: skip


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def kept_prediction(root: str, seeds: list[int], summaries: dict[str, dict[int, dict]]) -> dict | None:
    """The prediction of a --keep directory's runs made again from the role benches it holds (None
    without them). η, layout and batch shape come from its SETTINGS file; a directory from before that file
    gives them otherwise: η and the async process count from its async runs' summaries, the lent core from
    its co-run benches (timed only in that layout), the batch shape from --config and --set."""
    paths = {name: os.path.join(root, f) for name, f in ROLE_BENCHES.items()}
    if not seeds or not all(os.path.exists(p) for p in paths.values()):
        return None
    benches = {name: _load(p) for name, p in paths.items()}
    corun = {role: os.path.join(root, f) for role, f in CORUN_BENCHES.items()}
    has_corun = all(os.path.exists(p) for p in corun.values())
    recorded = os.path.join(root, SETTINGS)
    if os.path.exists(recorded):
        settings = _load(recorded)
        setup, lengths, source = ls.Setup(**settings["setup"]), settings["lengths"], recorded
    else:
        overrides = _overrides(root)
        ran = [summaries["async"][s] for s in seeds if s in summaries["async"]]
        max_staleness_values = {a.get("max_staleness") for a in ran} - {None}
        procs = {a.get("processes") for a in ran} - {None}
        setup = dataclasses.replace(
            _setup(overrides, has_corun), max_staleness=max(max_staleness_values,
                                                            default=_MAX_STALENESS.value),
            processes=max(procs, default=_PROCS.value),
        )  # fmt: skip
        lengths, source = reference_lengths(overrides), "runs"
    if setup.lent_core and has_corun:
        benches["corun"] = {role: _load(p) for role, p in corun.items()}
    return {"root": root, "seeds": seeds, "settings_from": source, "benches": benches, "setup": setup,
            "lengths": lengths, "predicted": ls.predict(benches, setup, lengths)}  # fmt: skip


def earlier_runs() -> dict | None:
    """The runs that --workload-from names, read before anything runs: {"dirs", "summaries", "η"} (the
    staleness bound of their async runs), None without the flag. Refuses a directory that holds the runs
    this command reports or makes (--report, --keep): those are not earlier runs."""
    if not _EARLIER.value:
        return None
    if not _REPORT.value and not _PREDICT.value:
        raise app.UsageError("--workload-from: an input of the prediction, which --nopredict leaves out")
    ours = {os.path.realpath(d) for d in [*_REPORT.value, _KEEP.value] if d}
    for d in _EARLIER.value:
        if os.path.realpath(d) in ours:
            raise app.UsageError(f"--workload-from={d}: the runs there are the ones this command reports or "
                                 "makes, not earlier runs")  # fmt: skip
    summaries, _, _ = kept_runs(_EARLIER.value, None, "--workload-from")
    max_staleness_values = {a.get("max_staleness") for a in summaries["async"].values()} - {None}
    return {"dirs": _EARLIER.value, "summaries": summaries, "max_staleness": min(max_staleness_values,
                                                                                 default=None)}


def earlier_line(prediction: dict, earlier: dict) -> str:
    """What the model gives with the earlier runs' train steps and completion lengths."""
    t, max_staleness = prediction["train_step_s"], earlier["max_staleness"]
    return (f"with the earlier runs' train steps and completion lengths ({','.join(earlier['dirs'])}: sync "
            f"{t['sync']:.3f} s, async {t['async']:.3f} s"
            f"{'' if max_staleness is None else f', η = {max_staleness}'}): "
            f"predicted {prediction['ratio']:.2f}")  # fmt: skip


def main(argv):
    del argv
    earlier = earlier_runs()
    if _REPORT.value:
        pick = {int(s) for s in _SEEDS.value} if _SEEDS.present else None
        summaries, one_core, seeds_of = kept_runs(_REPORT.value, pick)
        settings = {"report": _REPORT.value, "seeds": sorted(summaries["sync"]),
                    "cpus": sorted(os.sched_getaffinity(0))}  # fmt: skip
        kept = [kept_prediction(root, seeds, summaries) for root, seeds in seeds_of.items()]
        finish(summaries, one_core, settings, [k for k in kept if k], earlier)
        return
    lent = _lent_core()
    lent_core = lent is not None
    seeds = [int(s) for s in _SEEDS.value]
    if _SMOKE.value and _SEEDS.present == 0:
        seeds = seeds[:1]
    steps = SMOKE_STEPS if _SMOKE.value and not _STEPS.present else _STEPS.value
    try:
        slots = learning_slots.parse(_SLOTS.value)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    with tempfile.TemporaryDirectory() as tmp:
        root = _KEEP.value or tmp
        os.makedirs(root, exist_ok=True)
        overrides = _overrides(root)
        lengths = reference_lengths(overrides)
        tail = lengths["p99"] / lengths["median"]
        print(f"task reference completions: median {lengths['median']:g}, p99 {lengths['p99']:g} tokens "
              f"(p99/median {tail:.2f}), longest {lengths['max']}", flush=True)  # fmt: skip
        resolution = eval_resolution(overrides)
        print(f"held-out set: {resolution['prompts']} prompts; one of them answered differently moves the "
              f"accuracy by up to {resolution['heaviest']:.3f}", flush=True)  # fmt: skip
        setup = _setup(overrides, lent_core)
        settings = {"config": _CONFIG.value, "seeds": seeds, "steps": steps,
                    "max_staleness": _MAX_STALENESS.value,
                    "compile_cache": _CACHE.value, "async_processes": _PROCS.value,
                    "async_cpu_sets": _CPU_SETS.value or "pinned, a core each", "set": _SET.value,
                    "smoke": _SMOKE.value, "eval_resolution": resolution,
                    "cpus": sorted(os.sched_getaffinity(0)), "setup": dataclasses.asdict(setup),
                    "lengths": lengths}  # fmt: skip
        with open(os.path.join(root, SETTINGS), "w") as f:  # what --report needs to predict again
            json.dump(settings, f, indent=2)
        benches = time_roles(root, overrides) if _PREDICT.value else None
        if benches and lent_core:
            benches["corun"] = corun_roles(root, overrides, lent)
        predicted = ls.predict(benches, setup, lengths) if benches else None
        if predicted:
            print(f"predicted throughput async / sync: {predicted['ratio']:.2f} "
                  f"({predicted['async']['tokens_per_s']:.0f} / {predicted['sync']['tokens_per_s']:.0f} "
                  "trained tokens/s), before any run", flush=True)  # fmt: skip
            if lent_core:
                print("(async: the learner on every core, the sampler's included; the sampler on its own)",
                      flush=True)  # fmt: skip
                print(shared_line(predicted, benches), flush=True)
            elif _CPU_SETS.value:
                print(f"(async: the split model gives each role a core of its own, not "
                      f"--async-cpu-sets={_CPU_SETS.value})", flush=True)  # fmt: skip
            for host in (ls.host_split_line(predicted, _MAX_STALENESS.value),
                         ls.host_max_staleness_line(predicted)):
                if host:
                    print(host, flush=True)
            if earlier:
                drifted = ls.predict_realized(benches, setup, lengths, earlier["summaries"])
                if drifted:
                    print(earlier_line(drifted, earlier) + ", before any run", flush=True)
        per_mode = {m: overrides for m in ls.MODES}  # each mode's overrides: --slot-sweep's best slots
        if slots:
            settings["slot_sweep"] = swept = slot_sweep(root, seeds[0], slots, overrides)
            per_mode = {m: {**overrides, "sampler.num_slots": str(swept["best"][m]["slots"])}
                        for m in ls.MODES}  # fmt: skip
            with open(os.path.join(root, SETTINGS), "w") as f:
                json.dump(settings, f, indent=2)
        if _CACHE.value == "warm":  # the programs of both modes compiled once, untimed
            for mode in ls.MODES:
                s = run_one(mode, seeds[0], root, WARM_UP_STEPS, per_mode[mode], name=f"warm_up_{mode}")
                print(f"compile cache warm-up, {mode}: {s['wall_s']:.0f} s, {run_line(s)}", flush=True)
        summaries: dict[str, dict[int, dict]] = {m: {} for m in ls.MODES}
        for i, seed in enumerate(seeds):  # both modes of a seed back to back: a load change hits both alike
            for mode in ls.MODES if i % 2 == 0 else ls.MODES[::-1]:  # neither always goes first
                s = summaries[mode][seed] = run_one(mode, seed, root, steps, per_mode[mode])
                print(f"{mode} seed {seed}: final accuracy {s['final_accuracy']}, {s['wall_s']:.0f} s, "
                      f"{run_line(s)}", flush=True)  # fmt: skip
        one_core = None
        if _ONE_CORE.value:
            cores = sorted(os.sched_getaffinity(0))
            one_core = (seeds[0], run_one("sync", seeds[0], root, steps, per_mode["sync"], cores=cores[:1]))
    made = [{"seeds": seeds, "benches": benches, "setup": setup, "lengths": lengths, "predicted": predicted}]
    finish(summaries, one_core, settings, made if predicted else [], earlier)


def slot_sweep(root: str, seed: int, slots: list[int], overrides: dict[str, str]) -> dict:
    """learning_slots.sweep over `slots`: each mode's probes (`slots_<mode>_<n>` in `root`), printed."""
    def probe(mode: str, n: int) -> dict:
        values = {**overrides, **learning_slots.PROBE, "sampler.num_slots": str(n)}
        s = run_one(mode, seed, root, _SWEEP_STEPS.value, values, name=f"slots_{mode}_{n}")
        print(f"slot sweep, {mode} at {n} slots: {s['steady_train_tokens_per_s']:.0f} trained tokens/s "
              f"(steady), completions median {s['completion_length_p50']:g}", flush=True)  # fmt: skip
        return s

    result = learning_slots.sweep(ls.MODES, slots, probe)
    best = ", ".join(f"{m} {b['slots']} ({b['over_sync_best']:.2f}x sync's best)"
                     for m, b in result["best"].items())  # fmt: skip
    print(f"slot sweep ({_SWEEP_STEPS.value} steps of seed {seed} a probe):\n{learning_slots.table(result)}\n"
          f"each mode's runs use its best: {best}", flush=True)  # fmt: skip
    return result


def finish(
    summaries: dict[str, dict[int, dict]],
    one_core: tuple[int, dict] | None,
    settings: dict,
    predictions: list[dict],
    earlier: dict | None = None,
) -> None:
    """Reads the runs' summaries against the target (--target, else sync's mean final minus --margin)
    and against each seed's own (`ls.seed_targets`), and prints and writes (--out) the report: the
    JSON, the tables, and each prediction (its role benches' and its seeds': one per --report directory
    that holds benches) beside its seeds' measurement and beside the same model given what they realized,
    and given what the --workload-from runs realized (`earlier`)."""
    target = _TARGET.value
    if target is None:
        target = ls.default_target(list(summaries["sync"].values()), _MARGIN.value)
    rows = {m: {s: ls.run_row(summ, target) for s, summ in by.items()} for m, by in summaries.items()}
    report = ls.compare(rows)
    if one_core is not None:
        seed, summary = one_core
        report["overlap_bound"] = ls.overlap_bound(ls.run_row(summary, target), rows["sync"][seed],
                                                   len(os.sched_getaffinity(0)))  # fmt: skip
    targets = ls.seed_targets(summaries["sync"], _MARGIN.value)
    own_rows = {m: {s: ls.run_row(v, targets[s]) for s, v in by.items() if s in targets}
                for m, by in summaries.items()}  # fmt: skip
    own = {**ls.compare(own_rows), "targets": targets}
    settings = {**settings, "target": target, "margin": _MARGIN.value}
    made = [_against_its_seeds(p, rows, report, earlier) for p in predictions]
    out = {"settings": settings, "predictions": made, "rows": rows, **report, "own_targets": own}
    if len(set(summaries["sync"]) & set(summaries["async"])) >= 2:
        out["seed_averaged"] = ttt.study(summaries["sync"], summaries["async"], _CURVE_FRAC.value)
    print(json.dumps(out, indent=2, default=str))
    print(f"\ntarget held-out accuracy {target:.3f}\n" + ls.table(report))
    print("\n" + ls.own_target_table(own, targets))
    if "seed_averaged" in out:
        print("\n" + ttt.line(out["seed_averaged"]))
    for p in made:
        print_prediction(p, several=len(made) > 1 or "root" in p, earlier=earlier)
    if report.get("overlap_bound"):
        b = report["overlap_bound"]
        print(f"sync seed {one_core[0]}: {b['one_core_tokens_per_s']:.0f} trained tokens/s on one core, "
              f"{b['every_core_tokens_per_s']:.0f} on {b['cores']} ({b['core_scaling']:.2f}x): overlap alone "
              f"can buy at most {b['bound']:.2f}x sync")  # fmt: skip
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(out, f, indent=2, default=str)


def _against_its_seeds(p: dict, rows: dict[str, dict[int, dict]], report: dict, earlier: dict | None) -> dict:
    """A prediction beside its own seeds' mean throughput ratio, and the same model given what those seeds'
    runs realized (ls.predict_realized), and given what the earlier runs realized."""
    seeds = [s for s in p["seeds"] if s in report["paired"]]
    own = {m: {s: by[s] for s in seeds if s in by} for m, by in rows.items()}
    out = {k: p[k] for k in ("root", "settings_from") if k in p}
    if earlier:
        out["earlier_runs"] = earlier["dirs"]
        out["prediction_from_earlier_runs"] = ls.predict_realized(
            p["benches"], p["setup"], p["lengths"], earlier["summaries"]
        )
    return {
        **out,
        "seeds": seeds,
        "setup": dataclasses.asdict(p["setup"]),
        "prediction": p["predicted"],
        "prediction_realized": ls.predict_realized(p["benches"], p["setup"], p["lengths"], own),
        "measured_throughput_ratio": ls.mean_of([report["paired"][s]["throughput_ratio"] for s in seeds]),
    }


def print_prediction(p: dict, several: bool, earlier: dict | None) -> None:
    """The lines of one prediction: before the runs (from the warm start, and from the earlier runs'
    figures), measured, and from the runs' own figures."""
    where = f" [{p.get('root', '')}, seeds {','.join(map(str, p['seeds']))}]" if several else ""
    measured, predicted, realized = p["measured_throughput_ratio"], p["prediction"], p["prediction_realized"]
    print(f"\nthroughput async / sync{where}: predicted {predicted['ratio']:.2f}, measured "
          f"{measured or float('nan'):.2f} (mean of seeds)")  # fmt: skip
    if p.get("settings_from") == "runs":
        u = p["setup"]
        layout = "the lent core" if u["lent_core"] else f"{u['processes']} process(es)"
        print(f"({p['root']} has no {SETTINGS}: η = {u['max_staleness']} and {layout} from its runs and role "
              "benches, "
              f"{u['prompts']} x {u['samples']} samples a step from --config and --set)")  # fmt: skip
    if earlier and p.get("prediction_from_earlier_runs"):
        print(earlier_line(p["prediction_from_earlier_runs"], earlier))
    if realized:
        t = realized["train_step_s"]
        print(f"with the runs' own train steps (sync {t['sync']:.3f} s against the role bench's "
              f"{t['role_bench_every_core']:.3f}, async {t['async']:.3f} against "
              f"{t['role_bench_one_core']:.3f}) and completion lengths: "
              f"predicted {realized['ratio']:.2f}")  # fmt: skip
        for host in (ls.host_split_line(realized, p["setup"]["max_staleness"]),
                     ls.host_max_staleness_line(realized)):
            if host:
                print(f"from the runs' own figures: {host}")


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m benchmarks.bench_learning`
    run()
