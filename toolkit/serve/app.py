"""OpenAI-compatible HTTP server over a KV-cache artifact (FastAPI + uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with
`stream: true` as server-sent events), GET /v1/models, GET /health,
GET /metrics (Prometheus text). Requests share decode steps through
runners.decoding.batching.BatchEngine; the queue is bounded (429 + Retry-After).
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

from artifact.errors import InputError, ModelFileError
from models.artifacts import artifact_config, open_artifact
from models.tokenizer import TextTokenizer, load_tokenizer
from runners.decoding.batching import BatchEngine, QueueFull
from runners.decoding.batching import Request as EngineRequest
from runners.decoding.generate import Sampling
from runners.registry import create_runner
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
from toolkit.serve.streaming import TextStream

RETRY_AFTER_SECONDS = 1
RETRY_LATER = {"Retry-After": str(RETRY_AFTER_SECONDS)}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

# (text delta, finish reason or None, tokens generated so far)
Piece = tuple[str, str | None, int]


def create_app(
    artifact_dir: str | Path,
    *,
    backend: str = "ort-cpu",
    max_batch: int = 8,
    max_queue: int = 32,
    max_tokens: int = 256,
) -> FastAPI:
    artifact = open_artifact(artifact_dir)
    tokenizer = load_tokenizer(artifact, artifact_dir)
    runner = create_runner(backend, artifact)
    if "past_mask" not in {s.name for s in runner.input_specs}:
        raise ModelFileError(f"{artifact_dir}: not a batched KV-cache artifact; export it with --variant serving")
    metrics = Metrics()
    engine = BatchEngine(
        runner, artifact_config(artifact).max_positions, max_batch=max_batch, max_queue=max_queue, on_step=metrics.step
    )
    model_id = artifact.manifest.preset or Path(str(artifact.location)).name
    server = Server(tokenizer, engine, metrics, model_id, max_tokens)

    app = FastAPI(title="onnx-toolkit", lifespan=server.lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    app.add_exception_handler(RequestValidationError, server.invalid)
    app.get("/health")(server.health)
    app.get("/v1/models")(server.models)
    app.get("/metrics")(server.prometheus)
    app.post(COMPLETIONS)(server.completions)
    app.post(CHAT)(server.chat)
    return app


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


class Job:
    """One request in the engine, and the queue its events cross from the engine thread into the event loop."""

    def __init__(self, prompt_ids: list[int], body: GenerationFields, stop_ids: tuple[int, ...]):
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        seed = body.seed if body.seed is not None else secrets.randbits(32)
        self.request = EngineRequest(
            prompt_ids,
            body.max_tokens,
            Sampling(body.temperature, 0, body.top_p, seed),
            stop_ids,
            emit=lambda kind, value: loop.call_soon_threadsafe(self.events.put_nowait, (kind, value)),
        )


class Server:
    """The state the routes share, and one method per route.

    The route methods carry no docstrings or return annotations: FastAPI would put them in the
    OpenAPI document and derive response models from them.
    """

    def __init__(self, tokenizer: TextTokenizer, engine: BatchEngine, metrics: Metrics, model_id: str, max_tokens: int):
        self.tokenizer, self.engine, self.metrics = tokenizer, engine, metrics
        self.model_id, self.max_tokens = model_id, max_tokens
        self.stop_ids = tokenizer.stop_ids  # the tokenizer's eos and generation_config.json's
        self.draining = False

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        self.engine.start()
        yield
        self.draining = True  # uvicorn has stopped accepting; let in-flight requests finish
        await asyncio.to_thread(self.engine.stop, 30.0)

    def failed(
        self, endpoint: str, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> JSONResponse:
        """Count the request under `status` and answer with an OpenAI error."""
        self.metrics.count(endpoint, status)
        return error_response(status, message, param, headers)

    # ------------------------------------------------------------------ routes

    async def invalid(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_error(exc.errors())
        return self.failed(request.url.path, 422, message, param)

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
        return await self.answer(request, COMPLETIONS, body, body.prompt, chat=False)

    async def chat(self, body: ChatBody, request: Request):
        try:
            prompt = self.tokenizer.apply_chat_template([m.model_dump() for m in body.messages])
        except ModelFileError as exc:
            return self.failed(CHAT, 400, str(exc), "messages")
        return await self.answer(request, CHAT, body, prompt, chat=True)

    # ------------------------------------------------------------------ generation

    async def answer(self, request: Request, endpoint: str, body: GenerationFields, prompt: str, chat: bool):
        """Check the request against the server's limits, queue it, and answer whole or as server-sent events."""
        if self.draining:
            return self.failed(endpoint, 503, "shutting down", headers=RETRY_LATER)
        if body.max_tokens > self.max_tokens:
            return self.failed(
                endpoint, 400, f"max_tokens: {body.max_tokens} exceeds the server limit {self.max_tokens}", "max_tokens"
            )
        prompt_ids = self.tokenizer.encode(prompt)
        if not prompt_ids:
            return self.failed(endpoint, 400, "prompt: empty after tokenization", "prompt")
        job = Job(prompt_ids, body, self.stop_ids)
        try:
            self.engine.submit(job.request)
        except QueueFull:
            return self.failed(
                endpoint, 429, f"queue full ({self.engine.pending.maxsize} waiting); retry later", headers=RETRY_LATER
            )
        except InputError as exc:
            return self.failed(endpoint, 400, str(exc), "messages" if chat else "prompt")
        reply = Reply(chat=chat, model=self.model_id, prompt_tokens=len(prompt_ids))
        pieces = self.pieces(job, body.stop_strings())
        if body.stream:
            return StreamingResponse(self.events(pieces, job, reply, request, endpoint), media_type="text/event-stream")
        return await self.whole(pieces, reply, endpoint)

    async def pieces(self, job: Job, stops: list[str]) -> AsyncIterator[Piece]:
        """The answer's text as the engine sends tokens; the last piece has the finish reason.

        Stop strings apply to the decoded text and end the job; a stop id (the tokenizer's eos or one
        of generation_config.json's) ends it without being part of the text.
        """
        text = TextStream(self.tokenizer.decode, stops)
        tokens = 0
        while True:
            kind, value = await job.events.get()
            if kind == "error":
                raise RuntimeError(value)
            if kind == "done":
                yield text.flush(), ("stop" if value == "stop" else "length"), tokens
                return
            tokens += 1
            self.observe_token(job.request, tokens)
            if value in self.stop_ids:
                continue
            delta = text.push(value)
            if text.stopped:
                job.request.cancel()
                yield delta, "stop", tokens
                return
            if delta:
                yield delta, None, tokens

    def observe_token(self, request: EngineRequest, tokens: int) -> None:
        self.metrics.tokens.inc()
        if tokens == 1 and request.first_token_at is not None:
            self.metrics.ttft.observe(request.first_token_at - request.submitted)

    async def events(
        self, pieces: AsyncIterator[Piece], job: Job, reply: Reply, request: Request, endpoint: str
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed answer; a client that goes away frees its slot."""
        try:
            async for delta, finish, tokens in pieces:
                if await request.is_disconnected():
                    job.request.cancel()
                    return
                yield sse_event(reply.chunk(delta, finish, tokens))
            yield SSE_DONE
            self.metrics.count(endpoint, 200)
        except asyncio.CancelledError:
            job.request.cancel()
            raise
        except RuntimeError as exc:
            self.metrics.count(endpoint, 500)
            yield sse_event({"error": {"message": str(exc)}})

    async def whole(self, pieces: AsyncIterator[Piece], reply: Reply, endpoint: str) -> dict | JSONResponse:
        text, finish, count = "", "length", 0
        try:
            async for delta, finished, tokens in pieces:
                text += delta
                count = tokens
                if finished:
                    finish = finished
        except RuntimeError as exc:
            return self.failed(endpoint, 500, str(exc))
        self.metrics.count(endpoint, 200)
        return reply.whole(text, finish, count)
