"""The code sandbox: a security boundary around untrusted programs (rlimits, a uid of its own, network and
mount namespaces, a read-only view of the file system; `launcher.py` says what each layer stops).

`harness.py` and `wire.py` also run *inside* the sandbox, copied under this package's path with empty
package files, so they import the standard library only. This file is not copied: it may import freely.
"""

from jaxrl_async.rewards.sandbox.launcher import (
    SANDBOX_ENV,
    Capabilities,
    HarnessResult,
    SandboxLimits,
    SandboxResult,
    capabilities,
    kill_leftovers,
    pick_python,
    run_harness,
    run_python,
    run_raw,
)

__all__ = [
    "SANDBOX_ENV",
    "Capabilities",
    "HarnessResult",
    "SandboxLimits",
    "SandboxResult",
    "capabilities",
    "kill_leftovers",
    "pick_python",
    "run_harness",
    "run_python",
    "run_raw",
]
