"""JetStream's gRPC service (`jetstream.core.proto` Orchestrator: Decode, HealthCheck) on one address.

The servicer is JetStream's `LLMOrchestrator` over an `EngineDriver`; any JetStream client talks to it.
It listens on the given host only (JetStream's `JetStreamServer` binds every interface, "[::]").
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import grpc
from jetstream.core.orchestrator import LLMOrchestrator
from jetstream.core.proto import jetstream_pb2_grpc

from jaxrl_async.serving.driver import EngineDriver


async def serve(
    driver: EngineDriver, host: str, port: int, on_ready: Callable[[int], None] = lambda port: None
) -> None:
    """Serves until SIGINT or SIGTERM, then stops the server and the driver.

    Args:
      port: 0 picks a free port; `on_ready` receives the bound port once the server accepts calls.

    Raises:
      OSError: the address cannot be bound.
    """
    server = grpc.aio.server()
    jetstream_pb2_grpc.add_OrchestratorServicer_to_server(LLMOrchestrator(driver=driver), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    await server.start()
    on_ready(bound)
    try:
        await stopping.wait()
    finally:
        await server.stop(grace=5)
        driver.stop()
