"""The OpenAI wire format: request bodies, response and chunk objects, errors, server-sent events."""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field

SSE_DONE = "data: [DONE]\n\n"


class GenerationFields(BaseModel):
    """The OpenAI request fields both endpoints share."""

    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionBody(GenerationFields):
    prompt: str


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(GenerationFields):
    messages: list[Message] = Field(min_length=1)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param}}


def validation_error(errors: list[dict]) -> tuple[str, str]:
    """(message, param) for a request FastAPI could not parse: the first problem, named by its field."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"body: invalid JSON at character {first.get('loc', ('', '?'))[-1]} {detail}".strip(), "body"
    where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "body"
    return f"{where}: {first.get('msg', 'invalid request')}", where


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class Reply:
    """The envelope of one answer, streamed or whole: its id, object names, choice shape and usage."""

    def __init__(self, *, chat: bool, model: str, prompt_tokens: int):
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def usage(self, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def choice(self, text: str, finish: str | None, stream: bool) -> dict:
        if self.chat:
            key = "delta" if stream else "message"
            content = {"role": "assistant", "content": text} if not stream or text else {}
            return {"index": 0, key: content, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def chunk(self, delta: str, finish: str | None, completion_tokens: int) -> dict:
        """One streamed event; the last one (with a finish reason) carries the usage."""
        chunk = {
            "id": self.id,
            "object": self.object + (".chunk" if self.chat else ""),
            "created": self.created,
            "model": self.model,
            "choices": [self.choice(delta, finish, True)],
        }
        if finish:
            chunk["usage"] = self.usage(completion_tokens)
        return chunk

    def whole(self, text: str, finish: str, completion_tokens: int) -> dict:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [self.choice(text, finish, False)],
            "usage": self.usage(completion_tokens),
        }
