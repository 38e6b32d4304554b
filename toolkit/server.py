"""OpenAI-compatible HTTP server over a KV-cache artifact (FastAPI + uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with
`stream: true` as server-sent events), GET /v1/models, GET /health,
GET /metrics (Prometheus text). Requests share decode steps through
runners.batching.BatchEngine; the queue is bounded (429 + Retry-After).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, Field

from models.tokenizer import TextTokenizer
from runners.batching import BatchEngine, QueueFull
from runners.batching import Request as EngineRequest
from runners.generate import Sampling
from runners.registry import create_runner
from toolkit.artifacts import load_artifact
from toolkit.errors import InputError, ModelFileError

RETRY_AFTER_SECONDS = 1


class GenerationFields(BaseModel):
    """The OpenAI request fields both endpoints share."""

    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False


class CompletionBody(GenerationFields):
    prompt: str


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(GenerationFields):
    messages: list[Message] = Field(min_length=1)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("toolkit_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=self.registry)
        self.queue_depth = Gauge("toolkit_queue_depth", "requests waiting for a batch slot", registry=self.registry)
        self.active = Gauge("toolkit_active_requests", "requests in the running batch", registry=self.registry)
        self.batch_size = Histogram("toolkit_batch_size", "rows per decode step", registry=self.registry,
                                    buckets=(1, 2, 4, 8, 16, 32, 64))
        self.ttft = Histogram("toolkit_time_to_first_token_seconds", "submit to first token", registry=self.registry)
        self.token_latency = Histogram("toolkit_token_latency_seconds", "decode step time per token",
                                       registry=self.registry)
        self.tokens = Counter("toolkit_tokens_generated", "tokens generated", registry=self.registry)


def create_app(artifact_dir: str | Path, *, backend: str = "ort-cpu", max_batch: int = 8, max_queue: int = 32,
               max_tokens: int = 256) -> FastAPI:
    artifact = load_artifact(artifact_dir)
    if artifact.directory is None or not (artifact.directory / "tokenizer.json").is_file():
        raise ModelFileError(f"{artifact_dir}: no tokenizer in the artifact; export a checkpoint with --from")
    tokenizer = TextTokenizer.from_artifact(artifact.directory)
    runner = create_runner(backend, artifact)
    if "past_mask" not in {s["name"] for s in runner.input_specs}:
        raise ModelFileError(f"{artifact_dir}: not a batched KV-cache artifact; export it with --variant serving")
    config = artifact.config()
    metrics = Metrics()
    engine = BatchEngine(runner, config.max_positions, max_batch=max_batch, max_queue=max_queue,
                         on_step=lambda batch, seconds: (metrics.batch_size.observe(batch),
                                                         metrics.token_latency.observe(seconds)))
    model_id = artifact.manifest.get("preset") or Path(str(artifact.location)).name
    state = {"draining": False}

    async def lifespan(app):
        engine.start()
        yield
        state["draining"] = True  # uvicorn has stopped accepting; let in-flight requests finish
        await asyncio.to_thread(engine.stop, 30.0)

    app = FastAPI(title="onnx-toolkit", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics

    def error(status: int, message: str, param: str | None = None, headers=None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                       else "server_error", "param": param}}, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        metrics.requests.labels(request.url.path, "422").inc()
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "")
            return error(422, f"body: invalid JSON at character {first.get('loc', ('', '?'))[-1]} {detail}".strip(),
                         "body")
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "body"
        return error(422, f"{where}: {first.get('msg', 'invalid request')}", where)

    @app.get("/health")
    async def health():
        if state["draining"]:
            return error(503, "shutting down")
        return {"status": "ok", "active": engine.active, "queued": engine.queue_depth}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                            "owned_by": "onnx-toolkit"}]}

    @app.get("/metrics")
    async def prometheus():
        metrics.queue_depth.set(engine.queue_depth)
        metrics.active.set(engine.active)
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        return await serve(request, "/v1/completions", body, body.prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        messages = [m.model_dump() for m in body.messages]
        try:
            prompt = tokenizer.apply_chat_template(messages)
        except ModelFileError as exc:
            metrics.requests.labels("/v1/chat/completions", "400").inc()
            return error(400, str(exc), "messages")
        return await serve(request, "/v1/chat/completions", body, prompt, chat=True)

    async def serve(request: Request, endpoint: str, body, prompt: str, chat: bool):
        if state["draining"]:
            metrics.requests.labels(endpoint, "503").inc()
            return error(503, "shutting down", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        if body.max_tokens > max_tokens:
            metrics.requests.labels(endpoint, "400").inc()
            return error(400, f"max_tokens: {body.max_tokens} exceeds the server limit {max_tokens}", "max_tokens")
        prompt_ids = tokenizer.encode(prompt)
        if not prompt_ids:
            metrics.requests.labels(endpoint, "400").inc()
            return error(400, "prompt: empty after tokenization", "prompt")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        sampling = Sampling(body.temperature, 0, body.top_p, body.seed if body.seed is not None else secrets.randbits(32))
        stop_ids = tuple(t for t in (tokenizer.eos_id,) if t is not None)
        job = EngineRequest(prompt_ids, body.max_tokens, sampling, stop_ids,
                            emit=lambda kind, value: loop.call_soon_threadsafe(events.put_nowait, (kind, value)))
        try:
            engine.submit(job)
        except QueueFull:
            metrics.requests.labels(endpoint, "429").inc()
            return error(429, f"queue full ({engine.pending.maxsize} waiting); retry later",
                         headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        except InputError as exc:
            metrics.requests.labels(endpoint, "400").inc()
            return error(400, str(exc), "prompt" if not chat else "messages")
        created, rid = int(time.time()), ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        usage = lambda n: {"prompt_tokens": len(prompt_ids), "completion_tokens": n,  # noqa: E731
                           "total_tokens": len(prompt_ids) + n}

        def held_back(full: str) -> int:
            """Characters at the end of `full` that could still grow into a stop string."""
            hold = 0
            for stop in stops:
                for k in range(min(len(stop) - 1, len(full)), hold, -1):
                    if full.endswith(stop[:k]):
                        hold = k
                        break
            return hold

        async def produce():
            """Yield (text delta, finish_reason or None, tokens); stop strings apply to the decoded text.

            Text that might be the start of a stop string, or an incomplete UTF-8 sequence, is held
            back until it is decided; whatever is left is flushed when generation ends.
            """
            text, tokens = "", []
            while True:
                kind, value = await events.get()
                if kind == "error":
                    raise RuntimeError(value)
                if kind == "done":
                    rest = tokenizer.decode([t for t in tokens if t not in stop_ids])[len(text):]
                    yield rest, ("stop" if value == "stop" else "length"), tokens
                    return
                tokens.append(value)
                metrics.tokens.inc()
                if len(tokens) == 1 and job.first_token_at is not None:
                    metrics.ttft.observe(job.first_token_at - job.submitted)
                if value in stop_ids:
                    continue
                full = tokenizer.decode(tokens)
                cut = min((full.find(s) for s in stops if s and s in full), default=-1)
                if cut >= 0:
                    job.cancel()
                    yield full[len(text):cut], "stop", tokens
                    return
                if full.endswith("\ufffd"):
                    continue  # an incomplete UTF-8 sequence; wait for the rest
                end = len(full) - held_back(full)
                if end > len(text):
                    delta, text = full[len(text):end], full[:end]
                    yield delta, None, tokens

        def choice(delta: str, finish, stream: bool):
            if chat:
                key = "delta" if stream else "message"
                content = {"role": "assistant", "content": delta} if not stream or delta else {}
                return {"index": 0, key: content, "finish_reason": finish}
            return {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}

        obj = "chat.completion" if chat else "text_completion"
        if body.stream:
            async def sse():
                try:
                    async for delta, finish, tokens in produce():
                        if await request.is_disconnected():
                            job.cancel()
                            return
                        chunk = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                                 "model": model_id, "choices": [choice(delta, finish, True)]}
                        if finish:
                            chunk["usage"] = usage(len(tokens))
                        yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                    metrics.requests.labels(endpoint, "200").inc()
                except asyncio.CancelledError:  # the client went away: free the slot
                    job.cancel()
                    raise
                except RuntimeError as exc:
                    metrics.requests.labels(endpoint, "500").inc()
                    yield f"data: {json.dumps({'error': {'message': str(exc)}})}\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        text, finish, count = "", "length", 0
        try:
            async for delta, finished, tokens in produce():
                text += delta
                count = len(tokens)
                if finished:
                    finish = finished
        except RuntimeError as exc:
            metrics.requests.labels(endpoint, "500").inc()
            return error(500, str(exc))
        metrics.requests.labels(endpoint, "200").inc()
        return {"id": rid, "object": obj, "created": created, "model": model_id,
                "choices": [choice(text, finish, False)], "usage": usage(count)}

    return app
