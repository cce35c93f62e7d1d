"""The run's secret: the key that signs every message between the processes of a multi-process run.

The launchers (jaxrl-local-cluster, launch/tpu_pod.sh, launch/slurm_gpu.sbatch) generate a fresh one per
run and hand it to every process in the environment, never on a command line (which any user of the host
can read) or in a log:

  JAXRL_SECRET_FILE  a file holding the secret, readable by its owner only (mode 0600 or stricter);
  JAXRL_SECRET       the secret itself (the environment of a process is readable by its user only).

A secret is at least 32 characters (e.g. `secrets.token_hex(32)`, 64 hex digits).
"""

from __future__ import annotations

import os
import secrets
import stat

from jaxrl_async.runtime.errors import ClusterError

ENV_SECRET = "JAXRL_SECRET"
ENV_SECRET_FILE = "JAXRL_SECRET_FILE"
MIN_CHARS = 32
HOW = (
    "jaxrl-local-cluster, launch/tpu_pod.sh and launch/slurm_gpu.sbatch make one per run; a process started "
    f"otherwise needs the same secret as every other process of the run: {ENV_SECRET_FILE}=<a file only "
    f"you can read (chmod 600)> or {ENV_SECRET}=<at least {MIN_CHARS} random characters, e.g. from "
    "python -c 'import secrets; print(secrets.token_hex(32))'>"
)


class SecretError(ClusterError):
    """No usable secret; the message says how to provide one."""


def generate() -> str:
    """A fresh secret: 64 hex digits (256 random bits)."""
    return secrets.token_hex(32)


def write_file(path: str, secret: str) -> None:
    """Writes `secret` to a new file at `path` that only its owner can read (created 0600, never widened)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)


def present(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return bool(environ.get(ENV_SECRET_FILE) or environ.get(ENV_SECRET))


def require(environ=None) -> None:
    """Raises SecretError unless a secret is provided (a multi-process run checks before it connects)."""
    if not present(environ):
        raise SecretError(f"a multi-process run needs a secret that signs its messages: {HOW}")


def load(environ=None) -> bytes:
    """The run's secret, from JAXRL_SECRET_FILE or JAXRL_SECRET (the file wins).

    JAXRL_SECRET is then removed from this process's environment, so that the processes it starts (reward
    workers, data workers) do not inherit it.

    Raises:
      SecretError: neither is set, the file is readable by others or missing, or the secret is too short.
    """
    environ = os.environ if environ is None else environ
    require(environ)
    path = environ.get(ENV_SECRET_FILE)
    if path:
        try:
            st = os.stat(path)
            with open(path) as f:
                value = f.read().strip()
        except OSError as e:
            raise SecretError(f"{ENV_SECRET_FILE}={path}: cannot read it ({e.strerror})") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(
                f"{ENV_SECRET_FILE}={path}: readable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                "chmod 600 it"
            )
        where = ENV_SECRET_FILE
    else:
        value, where = environ[ENV_SECRET].strip(), ENV_SECRET
    environ.pop(ENV_SECRET, None)
    if len(value) < MIN_CHARS:
        raise SecretError(
            f"{where}: the secret has {len(value)} characters, at least {MIN_CHARS} needed: {HOW}"
        )
    return value.encode()
