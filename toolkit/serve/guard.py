"""What the server checks before a request reaches a route: the Host header, the API key, the body's size
and how long it takes to arrive. A pure ASGI middleware, so a refused request costs no body read, and
errors keep OpenAI's `{"error": {...}}` shape."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from dataclasses import dataclass, field

from starlette.exceptions import HTTPException

from toolkit.serve.schema import error_body

LOOPBACK = ("127.0.0.1", "localhost", "::1")
ANY_ADDRESS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class Limits:
    """The server's limits; each one is a `toolkit serve` flag (README "Security model")."""

    max_body_bytes: int = 1 << 21
    max_prompt_chars: int | None = None  # None: 64 characters per position of the model's context
    max_stops: int = 16
    max_stop_chars: int = 256
    max_choices: int = 16  # prompts x n in one request
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive: float = 5.0
    max_connections: int = 256
    request_timeout: float = 600.0
    shutdown_grace: float = 30.0

    def prompt_chars(self, max_positions: int) -> int:
        return self.max_prompt_chars if self.max_prompt_chars is not None else 64 * max_positions


@dataclass(frozen=True)
class Exposure:
    """Who may talk to the server: the API key, the Host names it answers to, CORS origins, docs."""

    api_key: str | None = None
    public_metrics: bool = False  # /metrics without the key
    allowed_hosts: tuple[str, ...] | None = None  # None: any Host header
    allowed_origins: tuple[str, ...] = ()
    docs: bool = False

    @staticmethod
    def hosts_for(bound: str, extra: tuple[str, ...] = ()) -> tuple[str, ...] | None:
        """The Host names a server bound to `bound` answers to: the loopback names for a loopback address
        (a DNS-rebinding page then cannot reach it under its own name), the address itself otherwise, and
        any for a wildcard address unless names are given."""
        if bound in ANY_ADDRESS:
            return tuple(extra) or None
        names = LOOPBACK if is_loopback(bound) else (bound,)
        return tuple(dict.fromkeys((*names, bound, *extra)))


def is_loopback(address: str) -> bool:
    return address in LOOPBACK or address.startswith("127.")


def host_name(header: str) -> str:
    """The name in a Host header, without the port (IPv6 literals keep their address, unbracketed)."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


async def send_error(send, status: int, message: str, *, code: str | None = None, headers: dict | None = None):
    body = json.dumps(error_body(status, message, code=code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


@dataclass
class Guard:
    app: object
    limits: Limits
    exposure: Exposure
    on_refused: object = None  # callable(path, status): counts refusals in /metrics
    protected: tuple[str, ...] = field(default=("/v1/",))

    def needs_key(self, path: str) -> bool:
        if self.exposure.api_key is None:
            return False
        if path == "/metrics":
            return not self.exposure.public_metrics
        return path.startswith(self.protected)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        refusal = self.refusal(scope, path)
        if refusal is not None:
            status, message, code, headers = refusal
            if self.on_refused is not None:
                self.on_refused(path, status)
            return await send_error(send, status, message, code=code, headers=headers)
        await self.app(scope, self.bounded(receive), send)

    def refusal(self, scope: dict, path: str):
        """(status, message, code, headers) of a request refused before the app, or None."""
        allowed = self.exposure.allowed_hosts
        host = header(scope, b"host")
        if allowed is not None and (host is None or host_name(host).lower() not in allowed):
            return 400, f"Host {host!r:.80} is not one this server answers to (--allowed-hosts)", "bad_host", None
        if self.needs_key(path):
            given = header(scope, b"authorization") or ""
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.exposure.api_key.encode()
            ):
                message = "missing or wrong API key; send the header Authorization: Bearer <key>"
                return 401, message, "invalid_api_key", {"WWW-Authenticate": "Bearer"}
        length = header(scope, b"content-length")
        if length is not None:
            if not length.isdigit():
                return 400, f"Content-Length {length!r:.40} is not a byte count", None, None
            if int(length) > self.limits.max_body_bytes:
                return 413, self.too_large(int(length)), None, None
        return None

    def too_large(self, size: int | None) -> str:
        got = f"{size} bytes" if size is not None else "more"
        return f"body: {got} is over this server's limit of {self.limits.max_body_bytes} bytes (--max-body-bytes)"

    def bounded(self, receive):
        """`receive` that refuses a body over the size limit, or one that takes longer than the body timeout
        to arrive (a client that sends it a byte at a time holds no slot for long)."""
        limit, timeout = self.limits.max_body_bytes, self.limits.body_timeout
        state = {"bytes": 0, "deadline": None, "done": False}

        async def wrapped():
            if state["done"]:
                return await receive()
            if state["deadline"] is None:
                state["deadline"] = time.monotonic() + timeout
            left = state["deadline"] - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except asyncio.TimeoutError:
                raise HTTPException(408, f"body: not received within {timeout:g} s (--body-timeout)") from None
            if message["type"] == "http.request":
                state["bytes"] += len(message.get("body", b""))
                if state["bytes"] > limit:
                    raise HTTPException(413, self.too_large(None))
                state["done"] = not message.get("more_body", False)
            return message

        return wrapped
