"""OpenAI-compatible HTTP server over a KV-cache artifact (FastAPI + uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with
`stream: true` as server-sent events), GET /v1/models, GET /health,
GET /metrics (Prometheus text). Requests share decode steps through
runners.decoding.batching.BatchEngine; the queue is bounded (429 + Retry-After).

The event loop only moves bytes: tokenizing, chat templates, detokenizing and stop strings run in worker
threads, so one large request cannot stall /health or another client's stream. Every request has a
deadline, a client that goes away frees its rows, and a shutdown ends what is still running at its grace
period with a final event (toolkit/serve/guard.py holds the limits checked before a route).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from artifact.errors import InputError, ModelFileError
from models.artifacts import artifact_config, open_artifact
from models.tokenizer import TextTokenizer, load_tokenizer
from runners.decoding.batching import BatchEngine, QueueFull
from runners.decoding.batching import Request as EngineRequest
from runners.decoding.generate import Sampling
from runners.registry import create_runner
from toolkit.serve.guard import Exposure, Guard, Limits
from toolkit.serve.jobs import Aborted, Choices, Group, Piece
from toolkit.serve.metrics import Metrics
from toolkit.serve.schema import (
    SSE_DONE,
    ChatBody,
    CompletionBody,
    GenerationFields,
    Reply,
    error_body,
    sse_event,
    validation_error,
)

RETRY_AFTER_SECONDS = 1
RETRY_LATER = {"Retry-After": str(RETRY_AFTER_SECONDS)}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT, "/v1/models", "/health", "/metrics")


def create_app(
    artifact_dir: str | Path,
    *,
    backend: str = "ort-cpu",
    max_batch: int = 8,
    max_queue: int = 32,
    max_tokens: int = 256,
    limits: Limits | None = None,
    exposure: Exposure | None = None,
) -> FastAPI:
    """The app; `guarded(app)` is what faces the network."""
    limits, exposure = limits or Limits(), exposure or Exposure()
    artifact = open_artifact(artifact_dir)
    tokenizer = load_tokenizer(artifact, artifact_dir)
    runner = create_runner(backend, artifact)
    if "past_mask" not in {s.name for s in runner.input_specs}:
        raise ModelFileError(f"{artifact_dir}: not a batched KV-cache artifact; export it with --variant serving")
    metrics = Metrics()
    max_positions = artifact_config(artifact).max_positions
    engine = BatchEngine(runner, max_positions, max_batch=max_batch, max_queue=max_queue, on_step=metrics.step)
    model_id = artifact.manifest.preset or Path(str(artifact.location)).name
    server = Server(tokenizer, engine, metrics, model_id, max_tokens, limits, max_positions)

    docs = {} if exposure.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="onnx-toolkit", lifespan=server.lifespan, **docs)
    app.state.engine, app.state.metrics, app.state.server = engine, metrics, server
    app.state.limits, app.state.exposure = limits, exposure
    app.add_exception_handler(RequestValidationError, server.invalid)
    app.add_exception_handler(HTTPException, server.http_error)
    app.add_exception_handler(Exception, server.crashed)
    app.get("/health")(server.health)
    app.get("/v1/models")(server.models)
    app.get("/metrics")(server.prometheus)
    app.post(COMPLETIONS)(server.completions)
    app.post(CHAT)(server.chat)
    if exposure.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(exposure.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    return app


def guarded(app: FastAPI) -> Guard:
    """The app behind the checks that come before any route: Host, API key, body size and time."""
    server: Server = app.state.server
    return Guard(app, app.state.limits, app.state.exposure, on_refused=server.refused)


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


class Server:
    """The state the routes share, and one method per route.

    The route methods carry no docstrings or return annotations: FastAPI would put them in the
    OpenAPI document and derive response models from them.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        engine: BatchEngine,
        metrics: Metrics,
        model_id: str,
        max_tokens: int,
        limits: Limits,
        max_positions: int,
    ):
        self.tokenizer, self.engine, self.metrics = tokenizer, engine, metrics
        self.model_id, self.max_tokens, self.limits = model_id, max_tokens, limits
        self.max_prompt_chars = limits.prompt_chars(max_positions)
        self.stop_ids = tokenizer.stop_ids  # the tokenizer's eos and generation_config.json's
        self.draining = False
        self.live: set[Group] = set()

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        self.engine.start()
        yield
        self.draining = True
        await asyncio.to_thread(self.engine.stop, 5.0)

    def drain(self) -> None:
        """The server is shutting down: refuse new requests, and end the ones still running at the grace
        period with a final event (called from the event loop when uvicorn starts its shutdown)."""
        self.draining = True
        asyncio.get_running_loop().call_later(self.limits.shutdown_grace, self.abort_all)

    def abort_all(self) -> None:
        for group in list(self.live):
            if group.abort(503, "server shutting down; retry the request"):
                self.metrics.cancelled.labels("shutdown").inc()

    def failed(
        self,
        endpoint: str,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> JSONResponse:
        """Count the request under `status` and answer with an OpenAI error."""
        self.metrics.count(endpoint, status)
        return error_response(status, message, param, headers, code)

    def refused(self, path: str, status: int) -> None:
        self.metrics.count(path if path in ENDPOINTS else "other", status)

    # ------------------------------------------------------------------ error handlers

    async def invalid(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_error(exc.errors())
        return self.failed(request.url.path, 422, message, param)

    async def http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        path = request.url.path
        message = exc.detail if exc.status_code not in (404, 405) else f"{request.method} {path}: {exc.detail}"
        self.refused(path, exc.status_code)
        return error_response(exc.status_code, str(message), headers=getattr(exc, "headers", None))

    async def crashed(self, request: Request, exc: Exception) -> JSONResponse:
        self.refused(request.url.path, 500)
        return error_response(500, f"internal error ({type(exc).__name__}); please report it")

    # ------------------------------------------------------------------ routes

    async def health(self):
        if self.draining:
            return error_response(503, "shutting down")
        return {"status": "ok", "active": self.engine.active, "queued": self.engine.queue_depth}

    async def models(self):
        return {
            "object": "list",
            "data": [{"id": self.model_id, "object": "model", "created": 0, "owned_by": "onnx-toolkit"}],
        }

    async def prometheus(self):
        return PlainTextResponse(
            self.metrics.exposition(self.engine.queue_depth, self.engine.active), media_type="text/plain; version=0.0.4"
        )

    async def completions(self, body: CompletionBody, request: Request):
        return await self.answer(request, COMPLETIONS, body, chat=False)

    async def chat(self, body: ChatBody, request: Request):
        return await self.answer(request, CHAT, body, chat=True)

    # ------------------------------------------------------------------ checks before any work

    def problem(self, body: GenerationFields, chat: bool) -> tuple[int, str, str, str | None] | None:
        """(status, message, param, code) of a request this server refuses before tokenizing, or None."""
        if body.model is not None and body.model != self.model_id:
            message = f"model {body.model!r:.100} does not exist; this server serves {self.model_id!r}"
            return 404, message, "model", "model_not_found"
        unsupported = body.unsupported()
        if unsupported is not None:
            name, takes = unsupported
            return 400, f"{name}: this server takes {takes}", name, None
        if body.requested_tokens() > self.max_tokens:
            message = f"max_tokens: {body.requested_tokens()} exceeds the server limit {self.max_tokens} (--max-tokens)"
            return 400, message, "max_tokens", None
        stops = body.stop_strings()
        if len(stops) > self.limits.max_stops:
            return (
                400,
                f"stop: {len(stops)} strings, this server takes at most {self.limits.max_stops} (--max-stops)",
                "stop",
                None,
            )
        longest = max((len(s) for s in stops), default=0)
        if longest > self.limits.max_stop_chars:
            message = f"stop: a string of {longest} characters, this server takes at most {self.limits.max_stop_chars} (--max-stop-chars)"
            return 400, message, "stop", None
        choices = body.n * (1 if chat else len(body.prompts()))
        if choices > self.limits.max_choices:
            message = f"n x prompts = {choices} choices, this server answers at most {self.limits.max_choices} (--max-choices)"
            return 400, message, "n", None
        texts = (
            [("messages", m.text()) for m in body.messages]
            if chat
            else [("prompt", p) for p in body.prompts() if isinstance(p, str)]
        )
        chars = sum(len(t) for _, t in texts)
        if chars > self.max_prompt_chars:
            message = f"{texts[0][0]}: {chars} characters, over this server's limit of {self.max_prompt_chars} (--max-prompt-chars)"
            return 400, message, texts[0][0], None
        for param, text in [*texts, *(("stop", s) for s in stops)]:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                message = (
                    f"{param}: a lone surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start} is not text"
                )
                return 400, message, param, None
        return None

    def tokenize(self, body: GenerationFields, chat: bool) -> list[list[int]]:
        """Each prompt's token ids (a worker thread runs this: a long prompt or template takes a while)."""
        if chat:
            return [self.tokenizer.encode_chat(body.chat())]
        vocab = self.tokenizer.vocab_size
        prompts = []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                prompts.append(self.tokenizer.encode(prompt))
                continue
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise InputError(f"prompt: token id {bad} is outside the vocabulary of {vocab}")
            prompts.append(list(prompt))
        return prompts

    # ------------------------------------------------------------------ generation

    async def answer(self, request: Request, endpoint: str, body: GenerationFields, chat: bool):
        """Check the request against the server's limits, queue it, and answer whole or as server-sent events."""
        if self.draining:
            return self.failed(endpoint, 503, "shutting down", headers=RETRY_LATER)
        problem = self.problem(body, chat)
        if problem is not None:
            status, message, param, code = problem
            return self.failed(endpoint, status, message, param, code=code)
        param = "messages" if chat else "prompt"
        try:
            prompts = await asyncio.to_thread(self.tokenize, body, chat)
        except (ModelFileError, InputError) as exc:
            return self.failed(endpoint, 400, str(exc), param)
        if any(not ids for ids in prompts):
            return self.failed(endpoint, 400, f"{param}: empty after tokenization", param)
        group = Group()
        for ids in prompts:
            for _ in range(body.n):
                seed = body.seed + len(group.requests) if body.seed is not None else secrets.randbits(32)
                group.add(ids, body.requested_tokens(), Sampling(body.temperature, 0, body.top_p, seed), self.stop_ids)
        submitted = []
        try:
            for engine_request in group.requests:
                self.engine.submit(engine_request)
                submitted.append(engine_request)
        except QueueFull:
            group.cancel()
            message = f"queue full ({self.engine.pending.maxsize} waiting); retry later"
            return self.failed(endpoint, 429, message, headers=RETRY_LATER)
        except InputError as exc:
            group.cancel()
            return self.failed(endpoint, 400, str(exc), param)
        self.live.add(group)
        group.deadline = group.loop.call_later(self.limits.request_timeout, self.expire, group)
        reply = Reply(chat=chat, model=self.model_id, prompt_tokens=sum(len(ids) for ids in prompts) * body.n)
        choices = Choices(group, self.tokenizer.decode, body.stop_strings(), self.stop_ids, self.observe_token)
        if body.stream:
            return StreamingResponse(self.events(choices, reply, request, endpoint), media_type="text/event-stream")
        return await self.whole(choices, reply, request, endpoint)

    def expire(self, group: Group) -> None:
        limit = self.limits.request_timeout
        if group.abort(504, f"the answer took longer than this server's limit of {limit:g} s (--request-timeout)"):
            self.metrics.cancelled.labels("timeout").inc()

    def finish(self, group: Group) -> None:
        self.live.discard(group)
        if group.deadline is not None:
            group.deadline.cancel()
        group.cancel()  # nothing of a finished, failed or abandoned request keeps running

    async def pieces(self, choices: Choices) -> AsyncIterator[Piece]:
        """The choices' text as the engine sends tokens, settled in a worker thread a batch of events at a
        time; each choice's last piece has its finish reason."""
        group = choices.group
        while not choices.done:
            events = [await group.events.get()]
            while not group.events.empty():
                events.append(group.events.get_nowait())
            if group.aborted is not None:
                raise group.aborted
            for piece in await asyncio.to_thread(choices.settle, events):
                yield piece

    def observe_token(self, request: EngineRequest, tokens: int) -> None:
        self.metrics.tokens.inc()
        if tokens == 1 and request.first_token_at is not None:
            self.metrics.ttft.observe(request.first_token_at - request.submitted)

    async def events(self, choices: Choices, reply: Reply, request: Request, endpoint: str) -> AsyncIterator[str]:
        """The server-sent events of a streamed answer; a client that goes away frees its rows."""
        ended = 0
        try:
            async for index, delta, finish in self.pieces(choices):
                if await request.is_disconnected():
                    self.metrics.cancelled.labels("disconnect").inc()
                    return
                ended += finish is not None
                usage = sum(choices.tokens) if ended == len(choices.finished) and finish else None
                yield sse_event(reply.chunk(index, delta, finish, usage))
            yield SSE_DONE
            self.metrics.count(endpoint, 200)
        except asyncio.CancelledError:
            self.metrics.cancelled.labels("disconnect").inc()
            raise
        except Aborted as exc:
            self.metrics.count(endpoint, exc.status)
            yield sse_event(error_body(exc.status, exc.message))
            yield SSE_DONE
        except RuntimeError as exc:
            self.metrics.count(endpoint, 500)
            yield sse_event(error_body(500, str(exc)))
        finally:
            self.finish(choices.group)

    async def whole(self, choices: Choices, reply: Reply, request: Request, endpoint: str):
        group = choices.group

        async def watch():  # the body is read: the next message is the client going away
            while (await request.receive())["type"] != "http.disconnect":
                pass
            if group.abort(499, "client disconnected"):
                self.metrics.cancelled.labels("disconnect").inc()

        watcher = asyncio.create_task(watch())
        texts, finishes = [""] * len(group.requests), ["length"] * len(group.requests)
        try:
            async for index, delta, finish in self.pieces(choices):
                texts[index] += delta
                finishes[index] = finish or finishes[index]
        except Aborted as exc:
            return self.failed(endpoint, exc.status, exc.message)
        except RuntimeError as exc:
            return self.failed(endpoint, 500, str(exc))
        finally:
            watcher.cancel()
            self.finish(group)
        self.metrics.count(endpoint, 200)
        return reply.whole(list(zip(texts, finishes, strict=True)), sum(choices.tokens))
