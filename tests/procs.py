"""Subprocesses a test runs beside its own work."""

import contextlib
import subprocess
import tempfile


@contextlib.contextmanager
def started(cmd, env, timeout=240):
    """Starts `cmd` and yields a `CompletedProcess` that is filled in (stdout, stderr, exit status) once the
    block has run and the command has ended: what the test computes meanwhile overlaps the command's
    start-up and compile."""
    res = subprocess.CompletedProcess(cmd, None)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, text=True, stdout=out, stderr=err)
        try:
            yield res
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out.seek(0), err.seek(0)
        res.returncode, res.stdout, res.stderr = proc.returncode, out.read(), err.read()
