"""What a benchmark records about the machine it ran on, beside its figures."""

from __future__ import annotations

import platform
import subprocess


def cpu_model() -> str:
    """`lscpu`'s model name (the processor string where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
        return names[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return platform.processor() or "unknown"
