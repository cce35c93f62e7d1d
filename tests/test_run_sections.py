"""The run-level config sections: each validates itself and names the flat config key; `validate` builds
them, then runs the named cross-checks."""

import pytest

from jaxrl_async.run_config import (
    CROSS_CHECKS,
    CheckpointSection,
    ConfigError,
    EvalSection,
    LogSection,
    MeshConfig,
    Schedule,
)


def _schedule(**kw):
    base = dict(mode="async", total_steps=4, prompts_per_step=2, samples_per_prompt=2, max_staleness=1)
    return Schedule(**{**base, **kw})


@pytest.mark.parametrize(
    "build,key",
    [
        (lambda: _schedule(mode="fast"), "config.mode"),
        (lambda: _schedule(total_steps=0), "config.total_steps"),
        (lambda: _schedule(prompts_per_step=1.5), "config.prompts_per_step"),
        (lambda: _schedule(samples_per_prompt=True), "config.samples_per_prompt"),
        (lambda: _schedule(max_staleness=0), "config.max_staleness: async mode"),
        (lambda: _schedule(max_head_staleness=-2), "config.max_head_staleness"),
        (lambda: EvalSection(every=-1, prompts=8, slots=8, weights="own"), "config.eval_every"),
        (lambda: EvalSection(every=2, prompts=0, slots=8, weights="own"), "config.eval_prompts"),
        (lambda: EvalSection(every=2, prompts=8, slots=0, weights="own"), "config.eval_slots"),
        (lambda: EvalSection(every=2, prompts=8, slots=8, weights="copy"), "config.eval_weights"),
        (lambda: CheckpointSection(every=-1, minutes=0.0, keep=3), "config.checkpoint_every"),
        (lambda: CheckpointSection(every=1, minutes=-0.5, keep=3), "config.checkpoint_minutes"),
        (lambda: CheckpointSection(every=1, minutes=0.0, keep=0), "config.checkpoint_keep"),
        (lambda: LogSection(every=0, text_samples=4), "config.log_every"),
        (lambda: LogSection(every=1, text_samples=-1), "config.text_samples"),
        (lambda: MeshConfig(weight_transport="shm"), "config.mesh.weight_transport: 'auto' or 'transfer'"),
    ],
)
def test_each_section_names_the_flat_key_it_refuses(build, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build()


def test_sync_mode_admits_nothing_ahead_and_the_eval_schedule_is_one_predicate():
    assert _schedule(mode="sync", max_staleness=4).effective_max_staleness == 0
    assert _schedule(max_staleness=3).effective_max_staleness == 3
    ev = EvalSection(every=3, prompts=8, slots=8, weights="own")
    assert [v for v in range(11) if ev.due(v, last=10)] == [0, 3, 6, 9, 10]
    at_the_end = EvalSection(every=0, prompts=8, slots=8, weights="own")
    assert [v for v in range(6) if at_the_end.due(v, last=5)] == [5]
    assert EvalSection(1, 8, 8, "shared").shares_weights and not ev.shares_weights


def test_the_cross_checks_are_named():
    names = [c.__name__ for c in CROSS_CHECKS]
    assert all(n.startswith("_check_") for n in names) and len(set(names)) == len(names)


def test_clip_note_names_a_proximal_clip_that_cannot_bind():
    from configs import letter_range, tiny_arith
    from jaxrl_async.run_config import clip_note, validate

    def note(cfg, **kw):
        c = cfg.get_config()
        c.workdir = "/tmp/unused"
        for key, value in kw.items():
            section, _, field = key.rpartition(".")
            setattr(c[section] if section else c, field, value)
        return clip_note(validate(c))

    assert "trainer.minibatches=1" in note(tiny_arith)  # async, decoupled PPO, one update a step
    assert note(tiny_arith, mode="sync") is None  # pi_behav = pi_theta: nothing stale to clip
    lagged = {"trainer.controlled_lag": 2, "checkpoint_every": 0, "checkpoint_minutes": 0}
    assert "pi_prox is pi_theta" in note(tiny_arith, mode="sync", **lagged)
    assert note(tiny_arith, **{"trainer.minibatches": 2}) is None  # pi_prox is the step's start
    assert note(letter_range) is None  # naive PPO clips against the behaviour policy
    assert "'gspo'" in note(letter_range, **{"trainer.loss": "gspo"})
