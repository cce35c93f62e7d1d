"""The long-tailed throughput workload (benchmarks/configs/bench_async.py) of benchmarks.bench_async,
benchmarks.split_sweep and benchmarks.window_check: its flags, defined once here, and the processes that
run it.

absl flags are process-global, so the three commands share these definitions; each adopts them as its own
(`flags.adopt_module_key_flags`, so `--help` lists them) and sets its defaults with `set_defaults` at
import, before the command line is parsed. The defaults below are python -m benchmarks.bench_async's.
"""

from __future__ import annotations

import dataclasses
import os

from absl import flags

from jaxrl_async.cli import REPO, module_command, run_logged

# The checkout: configs/ is not part of the installed package.

_STEPS = flags.DEFINE_integer("steps", 30, "Train steps of each run.", lower_bound=1)
_PROMPTS = flags.DEFINE_integer("prompts", 16, "Prompts per train step.", lower_bound=1)
_SAMPLES = flags.DEFINE_integer("samples", 4, "Completions per prompt.", lower_bound=1)
_SLOTS = flags.DEFINE_integer("slots", 256, "The sampler's decode slots (sampler.num_slots).", lower_bound=1)
_MEDIAN = flags.DEFINE_float("median", 24, "Median completion length (a lognormal mix).")
_P99 = flags.DEFINE_float("p99", 96, "99th-percentile completion length.")
_MAX_LEN = flags.DEFINE_integer("max-len", 128, "Longest completion (sampler.max_new_tokens).", lower_bound=1)
_MAX_STALENESS = flags.DEFINE_integer("max-staleness", 4, "Staleness bound of the asynchronous runs.",
                                      lower_bound=0)
_LAYERS = flags.DEFINE_integer("layers", 2, "Layer count (0 = the preset's).", lower_bound=0)


@dataclasses.dataclass(frozen=True)
class Workload:
    steps: int  # train steps per run
    prompts: int  # prompts per train step
    samples: int  # completions per prompt
    slots: int  # sampler decode slots
    median: float  # median completion length
    p99: float  # 99th-percentile completion length
    max_len: int  # longest completion
    max_staleness: int  # staleness bound of the asynchronous runs
    layers: int  # model layers (0: the preset's)


_HOLDERS = {
    "steps": _STEPS, "prompts": _PROMPTS, "samples": _SAMPLES, "slots": _SLOTS, "median": _MEDIAN,
    "p99": _P99, "max_len": _MAX_LEN, "max_staleness": _MAX_STALENESS, "layers": _LAYERS,
}  # fmt: skip


def set_defaults(**defaults) -> None:
    """A command's own defaults, by Workload field name; call at import, before flags are parsed."""
    for name, value in defaults.items():
        if name not in _HOLDERS:
            raise ValueError(f"set_defaults: no workload flag {name!r}; known: {sorted(_HOLDERS)}")
        flags.FLAGS.set_default(_HOLDERS[name].name, value)


def from_flags() -> Workload:
    return Workload(**{name: holder.value for name, holder in _HOLDERS.items()})


def config_flags(w: Workload, workdir: str, mode: str) -> list[str]:
    """`jaxrl-run` flags for one run of the workload."""
    caps = f"lognormal:median={w.median},p99={w.p99},max={w.max_len},seed=1"
    values = {
        "workdir": workdir,
        "mode": mode,
        "max_staleness": w.max_staleness,
        "total_steps": w.steps,
        "prompts_per_step": w.prompts,
        "samples_per_prompt": w.samples,
        "length_caps": caps,
        "model.n_layers": w.layers,
        "sampler.num_slots": w.slots,
        "sampler.max_new_tokens": w.max_len,
        "trainer.token_budget": max(256, w.max_len + 64),  # a row holds the longest sequence
    }
    return [f"--config={os.path.join(REPO, 'benchmarks', 'configs', 'bench_async.py')}"] + [
        f"--config.{k}={v}" for k, v in values.items()
    ]


def cluster_command(num_processes: int, pin_cores: bool) -> list[str]:
    """`jaxrl-local-cluster` with `num_processes` processes; the run's flags follow a `--`."""
    pin = ["--pin-cores"] if pin_cores else []
    return module_command("local_cluster", "--num-processes", str(num_processes), *pin)





def role_bench(w: Workload, root: str, cores: list[int] | None, name: str, decode_curve: bool = False) -> str:
    """benchmarks/bench_roles.py on the workload, on `cores` (None: every core); returns the JSON path."""
    out = os.path.join(root, f"{name}.json")
    run_flags = config_flags(w, os.path.join(root, name), "async")
    cmd = module_command("benchmarks.bench_roles", *run_flags, "--batches", "6", "--out", out)
    cmd += ["--decode_curve"] if decode_curve else []
    run_logged(cmd, cores, os.path.join(root, f"{name}.log"))
    return out
