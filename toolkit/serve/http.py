"""uvicorn, configured for exposure: a deadline for a request's headers (slowloris), an idle keep-alive
timeout, a connection limit, and a shutdown that ends late streams with a final event."""

from __future__ import annotations

import asyncio
import contextlib
import signal

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from toolkit.serve.guard import send_error


def too_many_connections(limit: int):
    """The ASGI app a connection past the limit talks to: every request gets 503 and the connection closes."""
    message = f"too many connections (this server takes {limit}, --max-connections); retry later"

    async def refuse(scope, receive, send):
        await send_error(send, 503, message, headers={"Connection": "close", "Retry-After": "1"})

    return refuse


def guarded_protocol(seconds: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for each request's headers and a connection limit.

    A connection that opens, or finishes a response, and does not complete the next request line and
    headers within `seconds` is closed: uvicorn itself only times out idle keep-alive connections, so a
    client sending a header byte at a time would hold its connection forever. A connection beyond
    `max_connections` gets an OpenAI-shaped 503 to its request and is closed."""
    refusal = too_many_connections(max_connections)

    class HeaderDeadline(H11Protocol):
        deadline: asyncio.TimerHandle | None = None

        def arm(self) -> None:
            self.disarm()
            self.deadline = self.loop.call_later(seconds, self.expire)

        def disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def expire(self) -> None:
            self.deadline = None
            if self.cycle is None or self.cycle.response_complete:
                if not self.transport.is_closing():
                    self.transport.close()

        def connection_made(self, transport):
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.app = refusal  # answered, not dropped: the client learns why and when to retry
            self.arm()

        def connection_lost(self, exc):
            self.disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers arrived
                self.disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self.arm()

    return HeaderDeadline


class Server(uvicorn.Server):
    """uvicorn re-raises the captured signal after its graceful shutdown, so a SIGTERM'd server would die
    with -15; here the signal only starts the shutdown and the process exits 0. The shutdown first tells
    the app to drain (`on_shutdown(grace)`), which ends requests still running at the grace period with a
    final event; uvicorn's own deadline comes a little later, so nothing is cut without one."""

    def __init__(self, config: uvicorn.Config, on_shutdown=None):
        super().__init__(config)
        self.on_shutdown = on_shutdown

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None):
        if self.on_shutdown is not None:
            self.on_shutdown()
        await super().shutdown(sockets)


def serve(guarded, *, host: str, port: int, limits, on_shutdown=None) -> None:
    """Run `guarded` (the app behind its Guard) until SIGTERM or SIGINT."""
    config = uvicorn.Config(
        guarded,
        host=host,
        port=port,
        log_level="warning",
        http=guarded_protocol(limits.header_timeout, limits.max_connections),
        timeout_keep_alive=limits.keep_alive,
        timeout_graceful_shutdown=limits.shutdown_grace + 5,
        lifespan="on",
    )
    Server(config, on_shutdown).run()
