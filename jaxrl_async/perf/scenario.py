"""Scenario files: one JSON describing hardware, model, workload and options for `build_system`.

Format (see configs/scenarios/*.json)::

    {"name": "...", "hardware": "h800" | {"preset": "h100", "mem_bytes": 8e10} | {all Hardware fields},
     "total_devices": 128, "max_staleness": 8,
     "model": {ModelShape fields} | {"hf_config": "path/to/config.json"},
     "workload": {"prompts_per_batch": 512, "samples_per_prompt": 16, "prompt_len": 1024,
                  "lengths": {"kind": "lognormal", "median": 8000, "p99": 40000, "max_len": 27648}},
     "options": {keyword arguments of build_system, e.g. "train_mfu": 0.43, "kv_reserve": "mean"},
     "balance_tol": 0.5,
     "sources": {...}, "published": {...}}   # free-form, copied into report.json
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any

from jaxrl_async.model.config import from_hf_config
from jaxrl_async.perf.hardware import Hardware, hardware_from_dict
from jaxrl_async.perf.shapes import ModelShape, shape_from_dict, shape_from_model_config
from jaxrl_async.perf.system import build_system
from jaxrl_async.perf.workload import Workload, length_dist_from_dict

_OPTIONS = set(inspect.signature(build_system).parameters) - {
    "hw",
    "shape",
    "workload",
    "total_devices",
    "max_staleness",
    "decode_bench",
    "train_bench",
}


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A parsed scenario; `raw` keeps the JSON for the report."""

    name: str
    hardware: Hardware
    shape: ModelShape
    workload: Workload
    total_devices: int
    max_staleness: int
    options: dict[str, Any]
    balance_tol: float
    raw: dict[str, Any]


def shape_from_hf_config(path: str, param_bytes: int = 2, kv_bytes: int = 2) -> ModelShape:
    """ModelShape from a Hugging Face config.json of a dense Llama/Qwen model."""
    with open(path) as f:
        c = json.load(f)
    cfg = from_hf_config(c)  # the model package's reader: same fields, same validation
    return shape_from_model_config(cfg, param_bytes, kv_bytes)


def model_from_dict(d: dict[str, Any]) -> ModelShape:
    """The "model" section: ModelShape fields, or {"hf_config": path}."""
    if "hf_config" in d:
        return shape_from_hf_config(d["hf_config"], d.get("param_bytes", 2), d.get("kv_bytes", 2))
    return shape_from_dict(d)


def workload_from_dict(d: dict[str, Any]) -> Workload:
    return Workload(
        prompts_per_batch=int(d["prompts_per_batch"]),
        samples_per_prompt=int(d["samples_per_prompt"]),
        prompt_len=int(d["prompt_len"]),
        lengths=length_dist_from_dict(d["lengths"]),
    )


def scenario_from_dict(d: dict[str, Any]) -> Scenario:
    """Validate and parse a scenario dict."""
    options = dict(d.get("options", {}))
    unknown = set(options) - _OPTIONS
    if unknown:
        raise ValueError(f"unknown options {sorted(unknown)}; expected a subset of {sorted(_OPTIONS)}")
    return Scenario(
        name=d.get("name", "scenario"),
        hardware=hardware_from_dict(d["hardware"]),
        shape=model_from_dict(d["model"]),
        workload=workload_from_dict(d["workload"]),
        total_devices=int(d["total_devices"]),
        max_staleness=int(d["max_staleness"]),
        options=options,
        balance_tol=float(d.get("balance_tol", 0.5)),
        raw=d,
    )


def load_scenario(path: str) -> Scenario:
    with open(path) as f:
        return scenario_from_dict(json.load(f))
