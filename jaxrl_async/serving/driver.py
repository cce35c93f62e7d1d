"""A driver for JetStream's gRPC servicer (`jetstream.core.orchestrator.LLMOrchestrator`) that runs one
JetStream engine, prefill and generate interleaved, in one thread.

Why not JetStream's own `orchestrator.Driver`: in google-jetstream 0.2.2 (its last release) the generate
thread calls `delete_pytree` on every prefix after `insert`, and `delete_pytree` calls `jax.tree_map`,
which jax removed (0.6); the thread raises AttributeError and JetStream then SIGKILLs its own process, so
the first request kills the server (its own orchestrator tests die the same way with jax 0.10). The
servicer needs only `place_request_on_prefill_queue`, `live` and `stop` of its driver, so this class
provides them and reuses JetStream's request, result and detokenization types
(`ActiveRequest`, `ResultTokens`, `token_utils.process_result_tokens`).

Differences from JetStream's Driver, on purpose:
  - A request that cannot be served (a prompt too long, a failed prefill) fails alone: its stream ends
    with the error, and the server goes on. JetStream truncates a long prompt to its end, silently.
  - Token-id requests (client-side tokenization) are prefilled as given: no BOS is prepended, as with
    `jaxrl-generate --prompt-ids`; the client adds BOS if its model wants one.
  - A cancelled request frees its slot at the next step.
"""

from __future__ import annotations

import logging
import queue
import threading

import numpy as np
from jetstream.core.orchestrator import ActiveRequest
from jetstream.engine import engine_api, token_utils

log = logging.getLogger(__name__)


class EngineDriver:
    """Serves requests with one engine: admits queued requests into free slots (prefill + insert), then
    runs one `generate` call and hands each live request its tokens, until stopped."""

    def __init__(self, engine: engine_api.Engine, params=None, max_queued: int = 1024):
        """
        Args:
          engine: any JetStream engine (JetStream's API: prefill / insert / generate on slots).
          params: what the engine's prefill and generate take (default: `engine.load_params()`).
          max_queued: requests waiting for a slot beyond this are refused (RESOURCE_EXHAUSTED).
        """
        self._engine = engine
        self._params = engine.load_params() if params is None else params
        self._tokenizer = engine.build_tokenizer(engine.get_tokenizer())
        self._queue: queue.Queue[ActiveRequest | None] = queue.Queue(max_queued)
        self._slots: list[ActiveRequest | None] = [None] * engine.max_concurrent_decodes
        self.live = True
        self._thread = threading.Thread(target=self._run, name="jetstream-engine", daemon=True)
        self._thread.start()

    # ----- what LLMOrchestrator and the server call -----

    def place_request_on_prefill_queue(self, request: ActiveRequest) -> None:
        """Queues a request (raises queue.Full when `max_queued` wait already)."""
        if not self.live:
            raise RuntimeError("the engine driver has stopped")
        self._queue.put(request, block=False)

    def stop(self) -> None:
        """Ends the engine thread; requests still running or queued end with an error."""
        self.live = False
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join()

    # ----- the engine thread -----

    def _run(self) -> None:
        try:
            state = self._engine.init_decode_state()
            while self.live:
                state = self._admit(state)
                if any(r is not None for r in self._slots):
                    state, result = self._engine.generate(self._params, state)
                    self._deliver(result.convert_to_numpy())
            self._fail_all(RuntimeError("the server is shutting down"))
        except Exception as e:  # the engine itself failed: no request can be served any more
            log.exception("engine driver stopped")
            self.live = False
            self._fail_all(e)

    def _admit(self, state):
        """Fills free slots from the queue; waits for a request only while no slot is live."""
        for slot, running in enumerate(self._slots):
            if running is not None:
                continue
            idle = all(r is None for r in self._slots)
            try:
                request = self._queue.get(block=idle, timeout=0.5 if idle else None)
            except queue.Empty:
                return state
            if request is None:  # stop()
                self.live = False
                return state
            if request.return_channel.cancelled():
                continue
            try:
                prefix = self._prefill(request)
            except Exception as e:  # this request's input: fail it alone
                _send(request.return_channel.set_exception, e)
                continue
            state = self._engine.insert(prefix, state, slot)
            request.complete = np.zeros((self._engine.samples_per_slot,), bool)
            self._slots[slot] = request
        return state

    def _prefill(self, request: ActiveRequest):
        longest = self._engine.max_prefill_length
        if isinstance(request.prefill_content, str):
            padded, true_length = self._tokenizer.encode(
                request.prefill_content,
                is_bos=not request.history_path,
                max_prefill_length=longest,
                jax_padding=False,
            )
        else:
            ids = np.asarray(request.prefill_content, np.int32)
            true_length = len(ids)
            padded = np.full((max(longest, true_length),), self._tokenizer.pad_id, np.int32)
            padded[:true_length] = ids
        if not 0 < true_length <= longest:
            raise ValueError(f"prompt of {true_length} tokens: the server takes 1 to {longest} tokens")
        return self._engine.prefill(params=self._params, padded_tokens=padded, true_length=true_length)

    def _deliver(self, result: engine_api.ResultTokens) -> None:
        for slot, request in enumerate(self._slots):
            if request is None:
                continue
            if request.return_channel.cancelled():
                self._slots[slot] = None
                continue
            samples, request.complete = token_utils.process_result_tokens(
                tokenizer=self._tokenizer,
                slot=slot,
                slot_max_length=request.max_tokens,
                result_tokens=result,
                complete=request.complete,
                is_client_side_tokenization=request.is_client_side_tokenization,
            )
            if not _send(request.enqueue_samples, samples):
                self._slots[slot] = None
            elif request.complete.all():
                _send(request.return_channel.close)
                self._slots[slot] = None

    def _fail_all(self, error: Exception) -> None:
        for slot, request in enumerate(self._slots):
            if request is not None:
                _send(request.return_channel.set_exception, error)
                self._slots[slot] = None
        while True:
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                return
            if request is not None:
                _send(request.return_channel.set_exception, error)


def _send(call, *args) -> bool:
    """Calls a request's return channel; False when the client's event loop is gone (the request is then
    dropped: one departed client must not stop the engine)."""
    try:
        call(*args)
        return True
    except RuntimeError as e:  # asyncio: "Event loop is closed"
        log.warning("dropping a request whose client is gone: %s", e)
        return False
