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
