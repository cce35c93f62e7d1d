"""TensorBoard values of multi-turn episodes, from the counters the pieces keep: finished `Episode`s, a
`ToolStats.take()` window and the sampler loop's `SamplerStats`. The run logs them per step under
`env/` (docs/environments.md lists what each means)."""

from __future__ import annotations

import numpy as np


def episode_metrics(episodes, tools: dict | None = None, sampler=None) -> dict[str, float]:
    """Per-step values.

    Args:
      episodes: the `Episode`s finished in the window.
      tools: a `ToolStats.take()` window (None: no tool values).
      sampler: the loop's `SamplerStats` (None: no parked-slot value); its fraction is since the start.

    Returns:
      env/episodes, env/turns_per_episode, env/observation_token_fraction (observation tokens over all
      tokens after the prompts), env/ends/<reason> (episodes that ended so); with `tools`: env/tool_calls,
      env/tool_errors, env/tool_timeouts, env/tool_latency_ms_mean and _max, env/tool_outputs_cleaned,
      env/tool_threads_abandoned; with `sampler`: env/parked_slot_fraction.
    """
    out: dict[str, float] = {"env/episodes": float(len(episodes))}
    if episodes:
        tokens = sum(e.length for e in episodes)
        out["env/turns_per_episode"] = float(np.mean([e.turns for e in episodes]))
        out["env/observation_token_fraction"] = sum(e.observation_tokens for e in episodes) / max(tokens, 1)
        for e in episodes:
            key = f"env/ends/{e.finish_reason or 'unknown'}"
            out[key] = out.get(key, 0.0) + 1.0
    if tools is not None:
        latencies = tools["latencies"]
        out["env/tool_calls"] = float(tools["calls"])
        out["env/tool_errors"] = float(sum(tools["errors"].values()))
        out["env/tool_timeouts"] = float(tools["errors"].get("timeout", 0))
        out["env/tool_outputs_cleaned"] = float(tools["cleaned"])
        out["env/tool_threads_abandoned"] = float(tools["abandoned"])
        if latencies:
            out["env/tool_latency_ms_mean"] = 1e3 * float(np.mean(latencies))
            out["env/tool_latency_ms_max"] = 1e3 * float(np.max(latencies))
    if sampler is not None:
        out["env/parked_slot_fraction"] = float(sampler.parked_fraction)
    return out


def add_tool_window(totals: dict, window: dict) -> dict:
    """Folds a `ToolStats.take()` window into running totals (plain values, so they cross processes in
    the actor's reports): calls, errors by kind, cleaned outputs, latency sum, count and max; `abandoned`
    is a level (threads still running past their deadline), not a count, so the newest one is kept."""
    out = dict(totals)
    out["tool_calls"] = out.get("tool_calls", 0) + int(window["calls"])
    errors = dict(out.get("tool_errors", {}))
    for kind, n in window["errors"].items():
        errors[kind] = errors.get(kind, 0) + int(n)
    out["tool_errors"] = errors
    out["tool_outputs_cleaned"] = out.get("tool_outputs_cleaned", 0) + int(window["cleaned"])
    latencies = window["latencies"]
    out["tool_latency_s_sum"] = out.get("tool_latency_s_sum", 0.0) + float(sum(latencies))
    out["tool_latency_count"] = out.get("tool_latency_count", 0) + len(latencies)
    out["tool_latency_s_max"] = max([out.get("tool_latency_s_max", 0.0), *map(float, latencies)])
    out["tool_threads_abandoned"] = int(window["abandoned"])
    return out


def tool_values(totals: list[dict]) -> dict[str, float]:
    """TensorBoard values of the actors' running totals (`add_tool_window`, plus `episodes`,
    `env_errors` and `parked_slot_fraction` of each actor), summed over the actors since the run
    started: env/episodes, env/env_errors, env/tool_calls, env/tool_errors, env/tool_errors/<kind>,
    env/tool_timeouts, env/tool_latency_ms_mean and _max, env/tool_outputs_cleaned,
    env/tool_threads_abandoned, env/parked_slot_fraction (the actors' mean)."""
    if not totals:
        return {}
    total = lambda key: float(sum(t.get(key, 0) for t in totals))  # noqa: E731
    errors: dict[str, float] = {}
    for t in totals:
        for kind, n in t.get("tool_errors", {}).items():
            errors[kind] = errors.get(kind, 0.0) + float(n)
    out = {
        "env/episodes": total("episodes"),
        "env/env_errors": total("env_errors"),
        "env/tool_calls": total("tool_calls"),
        "env/tool_errors": float(sum(errors.values())),
        "env/tool_timeouts": errors.get("timeout", 0.0),
        "env/tool_outputs_cleaned": total("tool_outputs_cleaned"),
        "env/tool_threads_abandoned": total("tool_threads_abandoned"),
        "env/parked_slot_fraction": total("parked_slot_fraction") / len(totals),
    }
    out |= {f"env/tool_errors/{kind}": n for kind, n in sorted(errors.items())}
    count = total("tool_latency_count")
    if count:
        out["env/tool_latency_ms_mean"] = 1e3 * total("tool_latency_s_sum") / count
        out["env/tool_latency_ms_max"] = 1e3 * max(float(t.get("tool_latency_s_max", 0.0)) for t in totals)
    return out


def rollout_values(rollouts) -> dict[str, float]:
    """Per-step values of the trained episodes (`Rollout`s with a `model_mask`; none: {}):
    env/turns_per_episode, env/observation_token_fraction (observation tokens over every token after the
    prompts) and env/ends/<reason> (trained episodes that ended so)."""
    episodes = [r for r in rollouts if r.model_mask is not None]
    if not episodes:
        return {}
    tokens = sum(len(r.model_mask) for r in episodes)
    observed = sum(int((~np.asarray(r.model_mask, bool)).sum()) for r in episodes)
    out = {
        "env/turns_per_episode": float(np.mean([r.metadata.get("turns", 1) for r in episodes])),
        "env/observation_token_fraction": observed / max(tokens, 1),
    }
    for r in episodes:
        key = f"env/ends/{r.finish_reason or 'unknown'}"
        out[key] = out.get(key, 0.0) + 1.0
    return out
