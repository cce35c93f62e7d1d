"""One home per knob: no field name is declared in two config dataclasses with the same meaning.

Scanned: RunConfig and every section it is built from (found through its type hints, so a new section is
scanned without touching this test), every dataclass of the trainer's and the sampler's config modules,
and the roles' configs (ActorConfig, LearnerConfig), which may reference sections but declare no knob.
A field whose type is itself a scanned dataclass (`RunConfig.schedule: Schedule`) references a section,
so it is not a declaration.
"""

import collections
import dataclasses
import inspect
import typing

import pytest

import jaxrl_async.sampler.config as sampler_config
import jaxrl_async.trainer.config as trainer_config
from jaxrl_async import run_config
from jaxrl_async.run_config import ConfigError, RunConfig, validate
from jaxrl_async.runtime.actor import ActorConfig
from jaxrl_async.runtime.learner import LearnerConfig

# Names declared in more than one scanned dataclass because they mean different things. Nothing else may
# be: a second declaration of the same knob is a second home, whose default or value can drift.
DIFFERENT_MEANINGS = {
    # How often, each in its own section: config.eval_every, config.checkpoint_every, config.log_every.
    "every": {"EvalSection", "CheckpointSection", "LogSection"},
    # The model's training/prefill attention kernel (model.attention) against the sampler's decode
    # attention over its KV cache (sampler.attention): two code paths, chosen separately.
    "attention": {"ModelSection", "SamplerConfig"},
    # Whether the run does the supervised warm start against whether it runs multi-turn episodes.
    "enabled": {"WarmStartConfig", "EnvConfig"},
    # The RL optimizer's learning rate against the supervised warm start's own.
    "lr": {"TrainConfig", "WarmStartConfig"},
    # The run's seed (parameter init, sampling streams) against the data's (order, synthetic problems).
    "seed": {"RunConfig", "DataConfig"},
    # The trainer's logprob temperature is not a knob: validate derives it from sampler.temperature
    # (run_config.DERIVED) and refuses it when set; TrainConfig declares it because the train step
    # runs without a RunConfig.
    "temperature": {"TrainConfig", "SamplerConfig"},
    # Tokens of one packed train row against the tokens of the sampler's KV cache.
    "token_budget": {"TrainConfig", "SamplerConfig"},
    # The versions to train (config.total_steps) against the learning-rate schedule's length
    # (trainer.total_steps; 0 = config.total_steps, refused if shorter).
    "total_steps": {"TrainConfig", "Schedule"},
}


def _hints(cls) -> dict:
    return typing.get_type_hints(cls, vars(inspect.getmodule(cls)))


def _config_classes() -> set[type]:
    found, todo = set(), [RunConfig, ActorConfig, LearnerConfig]
    for module in (trainer_config, sampler_config):
        todo += [c for c in vars(module).values() if inspect.isclass(c) and dataclasses.is_dataclass(c)
                 and c.__module__ == module.__name__]  # fmt: skip
    while todo:
        cls = todo.pop()
        if cls in found:
            continue
        found.add(cls)
        for hint in _hints(cls).values():
            for t in (hint, *typing.get_args(hint)):
                if inspect.isclass(t) and dataclasses.is_dataclass(t) and t.__module__.startswith("jaxrl_"):
                    todo.append(t)
    return found


def _declarations(classes) -> dict[str, set[str]]:
    """Field name -> the classes that declare it (references to another scanned class left out)."""
    out = collections.defaultdict(set)
    for cls in classes:
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in classes:
                continue
            out[f.name].add(cls.__name__)
    return out


def test_the_scan_reaches_every_section_and_component():
    names = {c.__name__ for c in _config_classes()}
    assert {"RunConfig", "Schedule", "EvalSection", "CheckpointSection", "LogSection", "ModelSection",
            "MeshConfig", "DataConfig", "RewardConfig", "SamplerConfig", "TrainConfig", "WarmStartConfig",
            "ActorConfig", "LearnerConfig", "Roles", "EnvConfig"} <= names  # fmt: skip


def test_the_scan_sees_a_field_declared_twice():
    @dataclasses.dataclass
    class Planted:
        dynamic_sampling: bool = False

    twice = _declarations(_config_classes() | {Planted})["dynamic_sampling"]
    assert twice == {"TrainConfig", "Planted"}


def test_no_field_is_declared_twice_with_the_same_meaning():
    twice = {name: owners for name, owners in _declarations(_config_classes()).items() if len(owners) > 1}
    unexplained = {n: sorted(o) for n, o in twice.items() if DIFFERENT_MEANINGS.get(n) != o}
    assert unexplained == {}, "declare each knob once; add to DIFFERENT_MEANINGS only names that differ"
    stale = sorted(set(DIFFERENT_MEANINGS) - set(twice))
    assert stale == [], "an allow-list entry no longer needed"


def test_run_level_knobs_have_one_default_in_the_base_config():
    """The run-level sections declare no defaults of their own (configs/base.py's are the only ones), and
    a config without one of those keys is refused naming it, rather than given a second default."""
    for cls in (run_config.EvalSection, run_config.CheckpointSection, run_config.LogSection):
        defaults = [f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING]
        assert defaults == [], cls.__name__
    from configs import base

    c = base.get_config()
    c.workdir = "/tmp/unused"
    del c["checkpoint_minutes"]
    with pytest.raises(ConfigError, match=r"config\.checkpoint_minutes: missing; configs/base\.py"):
        validate(c)
