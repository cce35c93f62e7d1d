"""Skips for a missing host capability, which CI turns into failures unless the host is declared without it.

A suite that needs something of the host (user namespaces for the sandbox, a C++ compiler for the CPU
kernels, /dev/shm for the shared-memory weight slots) skips where that is missing. On the machines CI runs
on all of it exists, so such a skip means the suite silently stopped running: tests/conftest.py fails it,
unless JAXRL_CI_ALLOW_MISSING (a comma-separated list of these names) says this host lacks it.
"""

import os
import re

import pytest

ALLOW_ENV = "JAXRL_CI_ALLOW_MISSING"
# name -> what it stands for (the names .ci/run and JAXRL_CI_ALLOW_MISSING use; py312 is .ci/run's own).
CAPABILITIES = {
    "sandbox": "the code sandbox's isolation layers (root or user namespaces: uid, netns, fsview)",
    "compiler": "a C++ compiler for the CPU kernels ($CXX, g++ or c++)",
    "shm": "shared memory (/dev/shm) for the weight slots",
    "py312": "a Python 3.12 for the jax 0.11 stage of .ci/run",
    "peft": "the peft library (the `test` extra) to load a LoRA run's PEFT export",
}
_TAG = re.compile(r"\[host lacks (\w+)\]")


def reason(capability: str, why: str) -> str:
    """A skip reason that names the capability (what the conftest hook recognises)."""
    if capability not in CAPABILITIES:
        raise ValueError(f"unknown host capability {capability!r}; known: {sorted(CAPABILITIES)}")
    return f"[host lacks {capability}] {why}"


def skip(capability: str, why: str):
    pytest.skip(reason(capability, why))


def capability_of(skip_reason: str) -> str | None:
    m = _TAG.search(skip_reason)
    return m.group(1) if m else None


def allowed_missing() -> set[str]:
    """The capabilities JAXRL_CI_ALLOW_MISSING declares absent; an unknown name is an error naming it."""
    names = {n.strip() for n in os.environ.get(ALLOW_ENV, "").split(",") if n.strip()}
    unknown = names - set(CAPABILITIES)
    if unknown:
        raise ValueError(f"{ALLOW_ENV}: unknown name(s) {sorted(unknown)}; known: {sorted(CAPABILITIES)}")
    return names
