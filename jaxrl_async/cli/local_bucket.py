"""A GCS bucket served on localhost by an emulator (`gcp-storage-emulator`, the "test" extra), for the
rehearsal and the tests: what a pod's hosts share instead of a disk.

`LocalBucket` starts the emulator in a process of its own on a free port, in memory, with one bucket, and
gives the environment that points every GCS client this project uses at it: gcsfs (under etils `epath`)
reads `STORAGE_EMULATOR_HOST`; tensorstore (under orbax) reads `TENSORSTORE_GCS_HTTP_URL` and takes
`GOOGLE_AUTH_TOKEN_FOR_TESTING` instead of looking for credentials. Subprocesses inherit `env`.

The emulator (2026.7) leaves out two things of the GCS JSON API that tensorstore's OCDBT writes (orbax's
format) rely on: object preconditions (`ifGenerationMatch`, `ifGenerationNotMatch`: 412 / 304) and the
`x-goog-generation` header of a download. Without them a checkpoint write fails at random with
"Malformed StorageGeneration". `_Handler` adds both on top of the emulator's own request handler; this
module's `main` serves that (`python -m jaxrl_async.cli.local_bucket --port P --bucket NAME`).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalBucket:
    """`with LocalBucket("b") as bucket:` serves gs://b until the block ends (everything in it is lost).

    Attributes:
      url: "gs://NAME".
      env: the variables a process needs to reach it (also set in this process's os.environ while open).
    """

    def __init__(self, name: str = "bucket", log_path: str | None = None, start_timeout_s: float = 60.0):
        self.name, self.log_path, self.start_timeout_s = name, log_path, start_timeout_s
        self.url = f"gs://{name}"
        self.env: dict[str, str] = {}
        self._proc: subprocess.Popen | None = None
        self._saved: dict[str, str | None] = {}

    def start(self) -> LocalBucket:
        try:
            import gcp_storage_emulator  # noqa: F401
        except ImportError:
            raise RuntimeError("a local bucket needs gcp-storage-emulator (the 'test' extra)") from None
        port = _free_port()
        host = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "jaxrl_async.cli.local_bucket", "--port", str(port), "--bucket",
               self.name]  # fmt: skip
        # The emulator logs every request: to a file when asked, else nowhere.
        out = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self._proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        finally:
            if self.log_path:
                out.close()
        self.env = {
            "STORAGE_EMULATOR_HOST": host,
            "TENSORSTORE_GCS_HTTP_URL": host,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "local-bucket",
            # gcsfs asks a storage-layout API that the emulator lacks (a warning per call); plain GCS here.
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }
        self._wait_ready(f"{host}/storage/v1/b/{self.name}")
        for k, v in self.env.items():
            self._saved[k] = os.environ.get(k)
            os.environ[k] = v
        return self

    def _wait_ready(self, probe: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the bucket emulator exited with status {self._proc.returncode}"
                                   + (f" (log: {self.log_path})" if self.log_path else ""))  # fmt: skip
            try:
                with urllib.request.urlopen(probe, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the bucket emulator did not answer {probe} "
                                   f"in {self.start_timeout_s:.0f} s")
            time.sleep(0.2)

    def stop(self) -> None:
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._saved = {}
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def __enter__(self) -> LocalBucket:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _handler_class():
    """The emulator's request handler plus preconditions and the generation header (module docstring)."""
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.server import RequestHandler

    class _Handler(RequestHandler):
        _generation_header: str | None = None

        def _object(self) -> tuple[str, str, dict] | None:
            """(bucket, object name, query) of a request on one object, else None."""
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            m = re.match(r"^(?:/download)?/storage/v1/b/([^/]+)/o/(.+)$", url.path)
            if m:
                return m.group(1), urllib.parse.unquote(m.group(2)), query
            m = re.match(r"^/upload/storage/v1/b/([^/]+)/o$", url.path)
            if m and "name" in query:
                return m.group(1), query["name"][0], query
            return None

        def _generation(self, bucket: str, name: str) -> str | None:
            try:
                return str(self.storage.get_file_obj(bucket, name)["generation"])
            except NotFound:
                return None

        def _refused(self) -> bool:
            """Answers 412 / 304 when a precondition fails (as GCS does); True if it did."""
            target = self._object()
            if target is None:
                return False
            bucket, name, query = target
            gen = self._generation(bucket, name)
            code = None
            if "ifGenerationMatch" in query and query["ifGenerationMatch"][0] != (gen or "0"):
                code = 412
            elif gen is not None and query.get("ifGenerationNotMatch", [None])[0] == gen:
                code = 304
            if code is None:
                if self.command == "GET" and query.get("alt") == ["media"]:
                    self._generation_header = gen
                return False
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True

        def end_headers(self):
            if self._generation_header is not None:
                self.send_header("x-goog-generation", self._generation_header)
                self._generation_header = None
            super().end_headers()

        def do_GET(self):
            if not self._refused():
                super().do_GET()

        def do_POST(self):
            if not self._refused():
                super().do_POST()

        def do_DELETE(self):
            if not self._refused():
                super().do_DELETE()

    return _Handler


def main() -> None:
    from functools import partial
    from http import server

    from gcp_storage_emulator.handlers import buckets
    from gcp_storage_emulator.storage import Storage

    parser = argparse.ArgumentParser(description="A GCS emulator with one bucket, in memory, on localhost.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bucket", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    storage = Storage(use_memory_fs=True)
    buckets.create_bucket(args.bucket, storage)
    httpd = server.HTTPServer(("127.0.0.1", args.port), partial(_handler_class(), storage))
    httpd.serve_forever()


if __name__ == "__main__":
    main()
