"""Start-up helpers that must run before JAX initialises a backend."""

from __future__ import annotations

import os


def prepare_devices(config) -> None:
    """Asks XLA for `config.mesh.fake_cpu_devices` CPU devices (used only when no accelerator is present).

    Must run before JAX is first used. An explicit XLA_FLAGS device count wins. On GPU/TPU hosts the CPU
    device count is irrelevant: the orchestrator meshes the default backend's devices.
    """
    n = int(config.mesh.fake_cpu_devices)
    if n > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        import jax

        jax.config.update("jax_num_cpu_devices", n)
