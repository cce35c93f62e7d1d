"""A thread pool whose threads are daemons, for calls that may never return (an environment's step, a
tool). A `concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits, so one call
that hangs would keep the actor's process from ending after the run; a daemon thread does not. A Python
thread cannot be killed: a stuck call keeps its thread until it returns, and its caller stops waiting at
its own deadline.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading


class DaemonPool:
    """Up to `n` daemon threads running submitted calls in order."""

    def __init__(self, n: int, name: str = "env"):
        self._n, self._started, self._name = n, 0, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        if self._started < self._n:  # a thread per call until there are n (idle ones wait on the queue)
            self._started += 1
            threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True).start()
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # the caller reads it from the future
                future.set_exception(e)

    def shutdown(self, cancel: bool = False) -> None:
        """Its threads exit once the queue ahead of them is done (`cancel`: calls not started are
        cancelled); a stuck one exits when its call returns."""
        if cancel:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in range(self._started):
            self._queue.put(None)
