"""Runs tool calls off the caller's thread, with a time-out, and turns whatever a tool does into bounded
text: a tool that hangs, raises, floods its output, returns non-UTF-8 bytes or hostile text gives an
error (or cleaned) text and a counted event; nothing it does reaches the caller as an exception.

Error kinds (counted in `ToolStats.errors`): "timeout", "raised", "flood", "non_utf8", "unknown_tool",
"malformed" (counted by the environment), "call_limit" (likewise). "hostile" (markers or control
characters removed from a tool's output) is counted in `ToolStats.cleaned`, not as an error: the
cleaned output is still the answer.

A Python thread cannot be killed: a tool that hangs keeps its worker until it returns. Its caller gets
the time-out answer at the deadline whatever happens, and later calls queued behind hung workers time
out at their own deadlines, so the caller never waits longer than `tool_timeout_s` per call; the
sandboxed "python" tool is killed by its own limits (`tools.py`). `ToolStats.abandoned` counts calls
still running past their deadline. The workers are daemon threads (`workers.DaemonPool`), so a tool that
never returns does not keep the process from exiting after the run.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import re
import threading
import time

from jaxrl_async.envs.calls import ToolCall
from jaxrl_async.envs.tools import ToolError, get_tool
from jaxrl_async.envs.workers import DaemonPool

# Characters a tool's output may hold besides printable ones; other control characters are removed
# (a terminal escape or a NUL is never part of an answer a model should learn from).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
MAX_MESSAGE_CHARS = 200  # an error message's length in an observation


@dataclasses.dataclass(frozen=True)
class ToolOutcome:
    """What one call gave: `text` (the tool's output, or the error message when `error` is set), the
    error kind or None, whether the output was cut (`flooded`) or cleaned (`cleaned`), and seconds from
    submission to answer."""

    text: str
    error: str | None
    latency_s: float
    flooded: bool = False
    cleaned: bool = False


class ToolStats:
    """Thread-safe counters of tool calls since the last `take()` (the run logs them per step)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reset()

    def _reset(self):
        self.calls = 0
        self.errors: collections.Counter = collections.Counter()
        self.cleaned = 0
        self.latencies: list[float] = []
        self.abandoned = 0

    def record(self, outcome: ToolOutcome) -> None:
        with self._lock:
            self.calls += 1
            self.latencies.append(outcome.latency_s)
            self.cleaned += outcome.cleaned
            if outcome.error is not None:
                self.errors[outcome.error] += 1

    def count_error(self, kind: str) -> None:
        """An error found before any tool ran (a malformed call, a call past the limit)."""
        with self._lock:
            self.errors[kind] += 1

    def count_cleaned(self) -> None:
        """An observation lost markers or characters the tokenizer cannot encode (hostile text)."""
        with self._lock:
            self.cleaned += 1

    def take(self) -> dict:
        """The counters as plain values, and a fresh window."""
        with self._lock:
            out = {
                "calls": self.calls,
                "errors": dict(self.errors),
                "cleaned": self.cleaned,
                "latencies": list(self.latencies),
                "abandoned": self.abandoned,
            }
            abandoned = self.abandoned
            self._reset()
            self.abandoned = abandoned  # still running: not a per-window count
        return out


def clean_output(raw, max_chars: int) -> tuple[str, str | None, bool, bool]:
    """(text, error kind or None, flooded, cleaned) of what a tool returned.

    Bytes must be UTF-8; anything but str or bytes is an error. The text is cut to `max_chars` (a flood:
    an error whose text is the output's beginning) and loses control characters (but newlines and tabs).
    """
    if isinstance(raw, bytes | bytearray):
        try:
            raw = bytes(raw[: 4 * max_chars + 4]).decode("utf-8")
        except UnicodeDecodeError as e:
            # A multi-byte character cut by the 4*max_chars slice is not the tool's fault: retry whole
            # only when the slice cut it.
            if e.start < 4 * max_chars - 3 or len(raw) <= 4 * max_chars + 4:
                return (
                    f"the tool returned bytes that are not UTF-8 (at byte {e.start})",
                    "non_utf8",
                    False,
                    False,
                )
            raw = bytes(raw[: e.start]).decode("utf-8")
    if not isinstance(raw, str):
        return f"the tool returned {type(raw).__name__}, not text", "raised", False, False
    flooded = len(raw) > max_chars
    text = raw[:max_chars]
    stripped = _CONTROL.sub("", text)
    return stripped, "flood" if flooded else None, flooded, stripped != text


class PendingCall:
    """A submitted call: `done()` once the tool answered or its deadline passed; `outcome()` waits at
    most until the deadline."""

    def __init__(self, future, submitted: float, timeout_s: float, executor: ToolExecutor):
        self._future, self._submitted, self._timeout = future, submitted, timeout_s
        self._executor = executor
        self._outcome: ToolOutcome | None = None

    def done(self) -> bool:
        return self._outcome is not None or self._future.done() or self._left() <= 0

    def _left(self) -> float:
        return self._submitted + self._timeout - time.monotonic()

    def outcome(self) -> ToolOutcome:
        if self._outcome is None:
            try:
                text, error, flooded, cleaned = self._future.result(timeout=max(0.0, self._left()))
                latency = time.monotonic() - self._submitted
            except concurrent.futures.TimeoutError:
                text, error, flooded, cleaned = (
                    f"timed out after {self._timeout:g} s",
                    "timeout",
                    False,
                    False,
                )
                latency = self._timeout
                self._executor.abandon(self._future)
            self._outcome = ToolOutcome(text, error, latency, flooded, cleaned)
            self._executor.stats.record(self._outcome)
        return self._outcome


class ToolExecutor:
    """A pool of `workers` threads running tool calls with a per-call time-out.

    Args:
      tools: the tool names calls may use (others get an "unknown_tool" error).
      timeout_s: the per-call deadline, counted from submission.
      workers: threads.
      max_chars: a tool's output is cut to this many characters (a flood) before anything else.
      stats: counters to record into (a new ToolStats by default).
    """

    def __init__(self, tools, timeout_s: float, workers: int, max_chars: int, stats: ToolStats | None = None):
        self.tools = {name: get_tool(name) for name in tools}
        self.timeout_s, self.max_chars = float(timeout_s), int(max_chars)
        self.stats = stats or ToolStats()
        self._pool = DaemonPool(workers, name="tool")  # a hung tool must not hold the process at exit

    def abandon(self, future) -> None:
        """A call ran past its deadline: counted until its thread returns."""
        with self.stats._lock:
            self.stats.abandoned += 1

        def returned(_):
            with self.stats._lock:
                self.stats.abandoned -= 1

        future.add_done_callback(returned)

    def _run(self, fn, call: ToolCall):
        try:
            raw = fn(*call.args, **dict(call.kwargs))
        except ToolError as e:
            return str(e)[:MAX_MESSAGE_CHARS], e.kind, False, False
        except Exception as e:  # a tool's bug is the episode's observation, never the caller's exception
            return f"{type(e).__name__}: {str(e)[:MAX_MESSAGE_CHARS]}", "raised", False, False
        return clean_output(raw, self.max_chars)

    def submit(self, call: ToolCall) -> PendingCall:
        """Starts `call` on a worker (or answers an unknown tool at once)."""
        now = time.monotonic()
        fn = self.tools.get(call.name)
        if fn is None:
            future = concurrent.futures.Future()
            message = f"unknown tool {call.name[:40]!r}; tools: {sorted(self.tools)}"
            future.set_result((message, "unknown_tool", False, False))
        else:
            future = self._pool.submit(self._run, fn, call)
        return PendingCall(future, now, self.timeout_s, self)

    def run(self, call: ToolCall) -> ToolOutcome:
        """`submit(call).outcome()`: blocks at most `timeout_s`."""
        return self.submit(call).outcome()

    def close(self) -> None:
        """Stops taking calls (those not started are cancelled); does not wait for hung tools."""
        self._pool.shutdown(cancel=True)
