"""The run configuration: an ml_collections ConfigDict (configs/*.py) validated into frozen dataclasses.

Each component owns its settings as a frozen dataclass validated in `__post_init__` (DataConfig,
RewardConfig, SamplerConfig, TrainConfig, WarmStartConfig); a config file's section of the same name is
built from that dataclass's defaults, so the dataclass docstring is the one place a field is documented.
`validate` turns the ConfigDict into a `RunConfig` before anything compiles and names the bad field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import ml_collections
from ml_collections import config_dict

from jaxrl_async import storage
from jaxrl_async.data import DataConfig
from jaxrl_async.envs.config import EnvConfig
from jaxrl_async.model.config import ATTENTION, DTYPES
from jaxrl_async.rewards import RewardConfig
from jaxrl_async.sampler import SamplerConfig
from jaxrl_async.trainer import TrainConfig
from jaxrl_async.trainer.warmstart import WarmStartConfig

SECTIONS = {
    "data": DataConfig,
    "reward": RewardConfig,
    "sampler": SamplerConfig,
    "trainer": TrainConfig,
    "warm_start": WarmStartConfig,
    "env": EnvConfig,
}
MODES = ("async", "sync")
EVAL_WEIGHTS = ("own", "shared")  # config.eval_weights (configs/base.py)
# The reward that grades each data task when config.reward.reward is "" (a row's own metadata["reward"]
# still overrides it).
TASK_REWARD = {
    "arithmetic": "arithmetic",
    "countdown": "countdown",
    "shift": "shift",
    "letter_range": "letter_range",
    "calc_tool": "calc_tool",
    "gsm8k": "math",
    "math": "math",
    "jsonl": "math",
    "parquet": "math",
}
# Fields a config file never sets: each is derived from the one knob named here, so two knobs that must
# agree cannot disagree.
DERIVED = {
    ("trainer", "temperature"): "config.sampler.temperature (the trainer's logprobs use the sampler's)",
}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field (config.section.field)."""


def _placeholder_type(hint) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    base = typing.get_origin(base) or base
    return base if isinstance(base, type) else object


def dataclass_section(cls, **overrides) -> ml_collections.ConfigDict:
    """A ConfigDict with `cls`'s fields and defaults (None defaults become typed placeholders), without
    the fields `validate` derives (DERIVED)."""
    hints = typing.get_type_hints(cls)
    out = ml_collections.ConfigDict()
    section = next((name for name, c in SECTIONS.items() if c is cls), None)
    for f in dataclasses.fields(cls):
        if (section, f.name) in DERIVED:
            continue
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = None
        if f.name in overrides:
            value = overrides.pop(f.name)
        if value is None:
            value = config_dict.placeholder(_placeholder_type(hints[f.name]))
        elif isinstance(value, dict | types.MappingProxyType):
            value = dict(value)
        elif dataclasses.is_dataclass(value):  # a nested section (trainer.lora): settable field by field
            value = ml_collections.ConfigDict(dataclasses.asdict(value))
        out[f.name] = value
    if overrides:
        raise ConfigError(f"{cls.__name__} has no fields {sorted(overrides)}")
    return out


def _section(name: str, cls, values: dict[str, Any], derived: dict[str, Any] | None = None):
    for field in values:
        if (name, field) in DERIVED:
            raise ConfigError(f"config.{name}.{field}: derived from {DERIVED[name, field]}; set that instead")
    values = {**values, **(derived or {})}
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"config.{name}.{unknown[0]}: unknown field (known: {sorted(known)})")
    for f in dataclasses.fields(cls):  # lists from the command line -> the tuples the dataclasses expect
        if isinstance(values.get(f.name), list):
            values[f.name] = tuple(values[f.name])
    try:
        return cls(**values)
    except ConfigError:
        raise  # already names its field
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"config.{name}: {e}") from e


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which model a run trains, and in which numerics (config.model; the shape itself is a ModelConfig,
    built from the checkpoint's config.json or the preset once the tokenizer is known)."""

    preset: str = "tiny"  # Shape preset (jaxrl_async.model.presets) when no checkpoint is given.
    checkpoint: str = ""  # Local HF checkpoint directory; overrides the preset's shape.
    dtype: str = "float32"  # Compute dtype (activations, matmuls, sampler weights): float32 | bfloat16.
    # Storage dtype of the trainer's master weights and optimizer state: float32 | bfloat16. Keep float32:
    # at lr 1e-6 an AdamW step is below half a bf16 ulp of most weights, so bf16 masters do not move.
    param_dtype: str = "float32"
    # Training and prefill attention: "auto" (cuDNN flash via jax.nn.dot_product_attention on GPU, the
    # splash Pallas kernel on TPU, "reference" on CPU) | "reference" | "dot_product" | "blocked" (plain-JAX
    # flash-style, any backend) | "splash" (TPU; refused on a GPU). docs/train.md, "Attention and long rows".
    attention: str = "auto"
    vocab_size: int = 0  # Preset override; 0 = the tokenizer's vocabulary size (rounded up to 8).
    n_layers: int = 0  # Preset override; 0 = the preset's layer count.

    def __post_init__(self):
        if not self.preset and not self.checkpoint:
            raise ConfigError(
                "config.model.checkpoint: required (an HF checkpoint directory, local or gs://), "
                "or set config.model.preset"
            )
        for name, allowed in (("dtype", DTYPES), ("param_dtype", DTYPES), ("attention", ATTENTION)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"config.model.{name}: {getattr(self, name)!r} not in {allowed}")
        for name, what in (("n_layers", "preset"), ("vocab_size", "the tokenizer's")):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"config.model.{name}: must be an integer >= 0 (0 = {what}), got {v!r}")
        if self.checkpoint and not storage.isdir(self.checkpoint):
            raise ConfigError(f"config.model.checkpoint: directory {self.checkpoint!r} not found")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """How the devices split into the sampler and trainer submeshes.

    One process: the sampler takes the first devices, the trainer the next ones (or the same ones with
    `colocate`). Several processes: each sampler process runs one replica of `sampler` over its own
    devices; the trainer mesh spans the devices of the trainer processes, in process order.
    """

    sampler: tuple[int, int] = (4, 1)  # (data, tensor) of one sampler replica; takes the first devices
    trainer: tuple[int, int] = (4, 1)  # (fsdp, tensor); takes the devices after the sampler's
    fake_cpu_devices: int = 8  # device count to create on a CPU-only machine (per process)
    # Both submeshes on the first devices (one GPU): the two roles then take turns on them.
    colocate: bool = False
    # Several processes (launch/local_cluster.py, a TPU pod, SLURM): the process ids running a sampler
    # replica of `sampler` each, and those running the trainer (one mesh over their devices; the first is
    # the learner lead). () and () = this one process does both.
    sampler_processes: tuple[int, ...] = ()
    trainer_processes: tuple[int, ...] = ()
    # With both lists empty and several processes, the roles follow from the meshes: the trainer takes
    # the first trainer_devices / devices-per-process processes, each replica the next whole processes
    # (jaxrl_async.runtime.cluster.Roles.from_topology). `sampler_replicas` (0 = as many as the rest
    # holds) and `devices_per_process` (0 = what each process sees) state the layout the config is
    # planned for: a run or a launcher whose hardware differs fails before anything compiles.
    sampler_replicas: int = 0
    devices_per_process: int = 0
    # How weights cross between processes. "auto": processes of one CPU host share each version through
    # shared-memory slots (one copy; jaxrl_async/runtime/shm_weights.py), all others pull it from the
    # trainer's transfer server; "transfer": every process pulls from the transfer server.
    weight_transport: str = "auto"

    def __post_init__(self):
        for name in ("sampler", "trainer"):
            shape = getattr(self, name)
            if len(shape) != 2 or any(not isinstance(x, int) or x < 1 for x in shape):
                raise ConfigError(f"config.mesh.{name}: must be two positive integers, got {shape!r}")
        for name in ("sampler_processes", "trainer_processes"):
            ids = getattr(self, name)
            if any(not isinstance(p, int) or p < 0 for p in ids):
                raise ConfigError(f"config.mesh.{name}: must be a tuple of process ids, got {ids!r}")
        for name in ("sampler_replicas", "devices_per_process"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"config.mesh.{name}: must be an integer >= 0, got {v!r}")
        if self.weight_transport not in ("auto", "transfer"):
            got = self.weight_transport
            raise ConfigError(f"config.mesh.weight_transport: 'auto' or 'transfer', got {got!r}")
        if self.colocate and (self.sampler_processes or self.trainer_processes):
            raise ConfigError("config.mesh.colocate: only for a single process (the roles share its devices)")

    @property
    def sampler_devices(self) -> int:
        return self.sampler[0] * self.sampler[1]

    @property
    def trainer_devices(self) -> int:
        return self.trainer[0] * self.trainer[1]

    @property
    def devices_needed(self) -> int:
        if self.colocate:
            return max(self.sampler_devices, self.trainer_devices)
        return self.sampler_devices + self.trainer_devices


def _int_at_least(name: str, v, low: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ConfigError(f"config.{name}: must be an integer >= {low}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How long the run trains, how big a step is, and how far admission may run ahead (config.mode,
    total_steps, prompts_per_step, samples_per_prompt, max_staleness, max_head_staleness; the run-level
    keys of configs/base.py, which documents each)."""

    mode: str
    total_steps: int
    prompts_per_step: int
    samples_per_prompt: int
    max_staleness: int
    max_head_staleness: int | None = None  # None = off (a config's negative value)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"config.mode: {self.mode!r} not in {MODES}")
        for name in ("total_steps", "prompts_per_step", "samples_per_prompt"):
            _int_at_least(name, getattr(self, name), 1)
        _int_at_least("max_staleness", self.max_staleness, 0)
        if self.mode == "async" and self.max_staleness < 1:
            raise ConfigError("config.max_staleness: async mode needs max_staleness >= 1 (0 is mode=sync)")
        if self.max_head_staleness is not None:
            _int_at_least("max_head_staleness", self.max_head_staleness, 0)

    @property
    def effective_max_staleness(self) -> int:
        """The admission bound actually used: 0 in sync mode."""
        return 0 if self.mode == "sync" else self.max_staleness


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """Held-out greedy pass@1 (config.eval_every, eval_prompts, eval_slots, eval_weights)."""

    every: int  # versions between evaluations; 0 = only the first and the last
    prompts: int
    slots: int
    weights: str  # "own" | "shared" (configs/base.py says what each costs)

    def __post_init__(self):
        _int_at_least("eval_every", self.every, 0)
        _int_at_least("eval_prompts", self.prompts, 1)
        _int_at_least("eval_slots", self.slots, 1)
        if self.weights not in EVAL_WEIGHTS:
            raise ConfigError(f"config.eval_weights: {self.weights!r} not in {EVAL_WEIGHTS}")

    @property
    def shares_weights(self) -> bool:
        """The eval engine decodes with the sampler's current weights (no copy of its own)."""
        return self.weights == "shared"

    def due(self, version: int, last: int) -> bool:
        """Whether `version` is evaluated in a run whose last version is `last` (the first received
        version always is: the actor evaluates whatever it starts with)."""
        return version == last or bool(self.every and version % self.every == 0)


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """When the trainer saves and what it keeps (config.checkpoint_every, checkpoint_minutes,
    checkpoint_keep); a run always saves its last version. The defaults are configs/base.py's."""

    every: int  # train steps between saves; 0 = by time only
    minutes: float  # also save when this many minutes passed since the last; 0 = off
    keep: int  # newest checkpoints kept (plus the best by held-out accuracy)

    def __post_init__(self):
        _int_at_least("checkpoint_every", self.every, 0)
        if not isinstance(self.minutes, int | float) or isinstance(self.minutes, bool) or self.minutes < 0:
            raise ConfigError(f"config.checkpoint_minutes: must be a number >= 0, got {self.minutes!r}")
        _int_at_least("checkpoint_keep", self.keep, 1)


@dataclasses.dataclass(frozen=True)
class LogSection:
    """What the learner lead writes (config.log_every, text_samples)."""

    every: int  # train steps between TensorBoard writes and summary lines
    text_samples: int  # completions written as TensorBoard text at each log step

    def __post_init__(self):
        _int_at_least("log_every", self.every, 1)
        _int_at_least("text_samples", self.text_samples, 0)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run needs, validated: one frozen section per concern, each read by the roles that
    need it (nothing is declared twice)."""

    workdir: str
    seed: int
    schedule: Schedule
    model: ModelSection
    tokenizer: str
    mesh: MeshConfig
    eval: EvalSection
    log: LogSection
    checkpoint: CheckpointSection
    verify_weights: bool
    length_caps: str
    compile_cache_dir: str  # "" = off (configs/base.py)
    record_schedule: bool  # config.record_schedule resolved ("auto": async runs; runtime/schedule_log.py)
    data: DataConfig
    reward: RewardConfig
    sampler: SamplerConfig
    trainer: TrainConfig
    warm_start: WarmStartConfig
    env: EnvConfig


def memory_sections(c: dict[str, Any]) -> dict[str, Any]:
    """The sampler and trainer dataclasses of a config (its `to_dict()`), validated as `component_sections`
    does: the two sections that size device memory. A plan check builds only these (it reads no data)."""
    sampler = _section("sampler", SamplerConfig, dict(c["sampler"]))
    trainer = dict(c["trainer"])
    if not trainer.get("total_steps"):  # 0: the schedule spans the run
        trainer["total_steps"] = c["total_steps"]
    derived = {"temperature": sampler.logprob_temperature}
    return {"sampler": sampler, "trainer": _section("trainer", TrainConfig, trainer, derived=derived)}


def component_sections(c: dict[str, Any]) -> dict[str, Any]:
    """The component dataclasses of a config (its `to_dict()`), derived fields filled in (DERIVED, the
    task's reward, the schedule's length); raises ConfigError naming the first bad field."""
    other = {name: cls for name, cls in SECTIONS.items() if name not in ("trainer", "reward", "sampler")}
    sections = {name: _section(name, cls, dict(c[name])) for name, cls in other.items()}
    reward = dict(c["reward"])
    reward["reward"] = reward.get("reward") or TASK_REWARD[sections["data"].task]  # "": the task's
    sections["reward"] = _section("reward", RewardConfig, reward)
    return {**sections, **memory_sections(c)}


def _given(c: dict[str, Any], key: str):
    """config.<key>. Every run-level knob has its one default in configs/base.py (no fallback here that
    could disagree with it): a config that lacks one did not start from it."""
    if key not in c:
        raise ConfigError(f"config.{key}: missing; configs/base.py declares it with its default (start from "
                          "its get_config())")  # fmt: skip
    return c[key]


def run_sections(c: dict[str, Any]) -> dict[str, Any]:
    """The run-level sections of a config (its `to_dict()`), each validated on its own."""
    head = _given(c, "max_head_staleness")
    return {
        "schedule": Schedule(
            mode=_given(c, "mode"), total_steps=_given(c, "total_steps"),
            prompts_per_step=_given(c, "prompts_per_step"),
            samples_per_prompt=_given(c, "samples_per_prompt"), max_staleness=_given(c, "max_staleness"),
            max_head_staleness=None if head is None or head < 0 else head,  # negative = off
        ),
        "eval": EvalSection(every=_given(c, "eval_every"), prompts=_given(c, "eval_prompts"),
                            slots=_given(c, "eval_slots"), weights=_given(c, "eval_weights")),
        "log": LogSection(every=_given(c, "log_every"), text_samples=_given(c, "text_samples")),
        "checkpoint": CheckpointSection(every=_given(c, "checkpoint_every"),
                                        minutes=_given(c, "checkpoint_minutes"),
                                        keep=_given(c, "checkpoint_keep")),
    }  # fmt: skip


# ----- cross-checks: each takes the built RunConfig and names the fields that disagree ----------------


def _check_data_files(run: RunConfig, num_devices: int | None) -> None:
    for field in ("path", "eval_path"):
        path = getattr(run.data, field)
        if path and not storage.exists(path):
            raise ConfigError(f"config.data.{field}: file {path!r} not found")


def _check_device_count(run: RunConfig, num_devices: int | None) -> None:
    mesh = run.mesh
    if num_devices is None or mesh.sampler_processes:
        return  # several processes: checked per role by jaxrl_async.runtime.build once they have joined
    if mesh.devices_needed > num_devices:
        how = "colocated on" if mesh.colocate else "+"
        raise ConfigError(
            f"config.mesh: sampler {mesh.sampler} {how} trainer {mesh.trainer} need {mesh.devices_needed} "
            f"devices, {num_devices} present (on a CPU-only host: "
            f"--config.mesh.fake_cpu_devices={mesh.devices_needed})"
        )


def _check_cpu_kernels(run: RunConfig, num_devices: int | None) -> None:
    for name in run.sampler.cpu_kernels:
        if run.mesh.sampler_devices != 1:
            raise ConfigError(
                f"config.sampler.{name}: 'cpu_kernel' runs on one CPU device, config.mesh.sampler is "
                f"{run.mesh.sampler} (use 'xla')"
            )
        if run.model.dtype != "float32":
            raise ConfigError(
                f"config.sampler.{name}: 'cpu_kernel' needs config.model.dtype='float32', got "
                f"{run.model.dtype!r}"
            )


def _check_length_caps(run: RunConfig, num_devices: int | None) -> None:
    if run.length_caps:
        from jaxrl_async.data.length_caps import length_cap_fn

        try:
            length_cap_fn(run.length_caps)
        except ValueError as e:
            raise ConfigError(f"config.length_caps: {e}") from None


def _check_trainer_schedule(run: RunConfig, num_devices: int | None) -> None:
    tr, sch = run.trainer, run.schedule
    if tr.total_steps < sch.total_steps:
        raise ConfigError(
            f"config.trainer.total_steps ({tr.total_steps}) < config.total_steps "
            f"({sch.total_steps}): the learning-rate schedule would end early"
        )
    if tr.minibatches > sch.prompts_per_step:
        raise ConfigError(
            f"config.trainer.minibatches={tr.minibatches}: each optimizer update needs at least one of the "
            f"batch's config.prompts_per_step={sch.prompts_per_step} groups"
        )
    if tr.controlled_lag and (run.checkpoint.every or run.checkpoint.minutes):
        raise ConfigError(  # a run resumed from a mid-run save would restart its lag (0..k-1 stale again)
            f"config.trainer.controlled_lag={tr.controlled_lag}: needs config.checkpoint_every=0 and "
            "config.checkpoint_minutes=0 (only the final checkpoint)"
        )


def _check_sequence_fits(run: RunConfig, num_devices: int | None) -> None:
    smp = run.sampler
    after = ("config.env.max_episode_tokens", run.env.max_episode_tokens) if run.env.enabled else \
        ("max_new_tokens", smp.max_new_tokens)  # fmt: skip
    longest = smp.max_prompt_len + after[1]
    if run.trainer.token_budget < longest:
        raise ConfigError(
            f"config.trainer.token_budget={run.trainer.token_budget}: a packed row must hold the longest "
            f"sequence, config.sampler.max_prompt_len + {after[0]} = {longest}"
        )
    if run.reward.overlong_buffer > smp.max_new_tokens:
        raise ConfigError(
            f"config.reward.overlong_buffer={run.reward.overlong_buffer}: the soft window must fit in "
            f"config.sampler.max_new_tokens={smp.max_new_tokens}"
        )


def _check_env(run: RunConfig, num_devices: int | None) -> None:
    """Multi-turn episodes (config.env): refused where the run would not honour a field."""
    env, smp = run.env, run.sampler
    if not env.enabled:
        default = EnvConfig()
        for f in dataclasses.fields(EnvConfig):
            if getattr(env, f.name) != getattr(default, f.name):
                raise ConfigError(f"config.env.{f.name}: has no effect with config.env.enabled=False "
                                  "(single-turn completions)")  # fmt: skip
        return
    from jaxrl_async.envs import load_environment
    from jaxrl_async.envs.tools import registered_tools

    if env.environment:  # first: its module may register the tools it names
        try:
            load_environment(env.environment)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    unknown = [t for t in env.tools if t not in registered_tools()]
    if unknown:
        known = registered_tools()
        raise ConfigError(
            f"config.env.tools: {unknown} not registered; registered: {known} (a custom tool registers when "
            "the module of config.env.environment is imported)"
        )
    for name in smp.cpu_kernels:  # extend (the observation's prefill) runs on XLA's slotted or paged cache
        raise ConfigError(
            f"config.sampler.{name}='cpu_kernel': multi-turn episodes (config.env.enabled) append "
            "observations with XLA ops on unpacked weights; use 'xla' or 'auto'"
        )
    # The longest sequence a slot holds: the slotted cache's slot length, the paged cache's max_seq_len.
    # "auto" is the slotted cache on CPU; where it turns out paged (an accelerator) the actor's build checks
    # again (runtime/episodes.py, `episode_kernels`).
    capacity = smp.max_seq_len if smp.attention == "paged_kernel" else smp.slot_len
    if smp.max_prompt_len + env.max_episode_tokens > capacity:
        raise ConfigError(
            f"config.env.max_episode_tokens={env.max_episode_tokens}: config.sampler.max_prompt_len="
            f"{smp.max_prompt_len} + the episode's tokens exceed the {capacity} tokens a sampler slot holds "
            "(raise config.sampler.token_budget for the slotted cache, or max_new_tokens)"
        )
    if run.reward.overlong_buffer:
        raise ConfigError("config.reward.overlong_buffer: the overlong shaping grades one completion's "
                          "length; multi-turn episodes (config.env.enabled) need 0")  # fmt: skip
    if run.length_caps:
        raise ConfigError("config.length_caps: per-prompt generation caps are for single-turn completions; "
                          "multi-turn episodes (config.env.enabled) bound turns with config.env")  # fmt: skip


def _check_tool_task(run: RunConfig, num_devices: int | None) -> None:
    """The calc_tool task is answered through the calculator: a run of it without episodes or without
    that tool could only score what the model computes in its head (jaxrl_async.data.calc_tool)."""
    if run.data.task != "calc_tool":
        return
    if not run.env.enabled:
        raise ConfigError("config.env.enabled: config.data.task='calc_tool' is solved with the calculator in "
                          "multi-turn episodes; set it True (configs/calc_tool.py)")  # fmt: skip
    if "calculator" not in run.env.tools:
        raise ConfigError(f"config.env.tools={run.env.tools}: config.data.task='calc_tool' needs "
                          "'calculator' (its reference episodes call it)")  # fmt: skip


CROSS_CHECKS = (
    _check_data_files,
    _check_device_count,
    _check_cpu_kernels,
    _check_length_caps,
    _check_trainer_schedule,
    _check_env,
    _check_tool_task,
    _check_sequence_fits,
)


def clip_note(run: RunConfig) -> str | None:
    """What a proximal-policy loss does with one optimizer update a step on stale samples, or None.

    With trainer.minibatches = 1 the proximal policy is pi_theta itself, so a loss that clips against it
    (decoupled PPO, GSPO, M2PO) never clips: stale tokens are corrected by the behaviour weight alone.
    On letter_range that ended 7 points below sync at η = 2, and naive PPO (which clips against the
    behaviour policy) level with it (docs/history/benchmarks.md). Logged, not refused: tiny_arith runs it so.
    """
    from jaxrl_async.trainer.losses import reads_prox

    stale = run.schedule.effective_max_staleness > 0 or run.trainer.controlled_lag > 0
    if not stale or run.trainer.minibatches != 1 or not reads_prox(run.trainer.loss):
        return None
    return (
        f"config.trainer.loss={run.trainer.loss!r} with trainer.minibatches=1: pi_prox is pi_theta, so its "
        "clip never binds and stale tokens keep their full behaviour weight (loss='ppo' clips against the "
        "behaviour policy; minibatches > 1 gives pi_prox a step to bound)"
    )


def _compile_cache_dir(v) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"config.compile_cache_dir: a directory path or \"\" (off), got {v!r}")
    return v


def _record_schedule(v, mode: str) -> bool:
    # Multi-turn episodes are recorded too: their environments' answers and where they landed.
    if v not in ("auto", "on", "off"):
        raise ConfigError(f'config.record_schedule: "auto", "on" or "off", got {v!r}')
    return v == "on" or (v == "auto" and mode == "async")


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None) -> RunConfig:
    """Builds the RunConfig, section by section (each validates itself), then runs the named cross-checks
    (CROSS_CHECKS); raises ConfigError naming the first bad field.

    Args:
      config: the ConfigDict from a configs/*.py file plus command-line overrides.
      num_devices: devices present (None = skip the device-count check).
    """
    c = config.to_dict()
    if not c.get("workdir"):
        raise ConfigError("config.workdir: required (e.g. --config.workdir=runs/my_run)")
    run = RunConfig(
        workdir=c["workdir"],
        seed=int(_given(c, "seed")),
        **run_sections(c),
        model=_section("model", ModelSection, dict(_given(c, "model"))),
        tokenizer=_given(c, "tokenizer"),
        mesh=_section("mesh", MeshConfig, dict(_given(c, "mesh"))),
        verify_weights=bool(_given(c, "verify_weights")),
        length_caps=_given(c, "length_caps"),
        compile_cache_dir=_compile_cache_dir(_given(c, "compile_cache_dir")),
        record_schedule=_record_schedule(_given(c, "record_schedule"), _given(c, "mode")),
        **component_sections(c),
    )
    for check in CROSS_CHECKS:
        check(run, num_devices)
    return run
