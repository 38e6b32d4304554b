"""The OpenAI wire format: request bodies, response and chunk objects, errors, server-sent events.

Request bodies are strict: a field of the wrong JSON type (`max_tokens: true`, `temperature: "0.5"`) or a
field OpenAI's API does not have is a 422 naming it. Fields OpenAI has that change the answer and this
server does not implement (`logprobs`, penalties, `logit_bias`, `echo`, `best_of`, `suffix`) are accepted
only at their neutral value and refused by name otherwise, never ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SSE_DONE = "data: [DONE]\n\n"
STRICT = ConfigDict(strict=True, extra="forbid")


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = True  # the last chunk always carries the usage


class GenerationFields(BaseModel):
    """The OpenAI request fields both endpoints share."""

    model_config = STRICT
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def requested_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else 16

    def unsupported(self) -> tuple[str, str] | None:
        """(field, what this server takes) for the first field set to something this server does not do."""
        neutral = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None, **self._neutral()}
        for name, value in neutral.items():
            if getattr(self, name) not in (value, {}):
                return name, f"only {json.dumps(value)} (not implemented by this server)"
        return None

    def _neutral(self) -> dict:
        return {}


class CompletionBody(GenerationFields):
    # One prompt, a list of prompts, token ids, or a list of token-id lists (one choice each).
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def _neutral(self) -> dict:
        return {"logprobs": None, "echo": False, "best_of": None, "suffix": None}

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The content as one string; text parts are joined with newlines, as vLLM and llama.cpp's server do."""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class ChatBody(GenerationFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None

    def _neutral(self) -> dict:
        return {"logprobs": False, "top_logprobs": None}

    def requested_tokens(self) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().requested_tokens()

    def chat(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


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

    def choice(self, index: int, text: str, finish: str | None, stream: bool) -> dict:
        if self.chat:
            key = "delta" if stream else "message"
            content = {"role": "assistant", "content": text} if not stream or text else {}
            return {"index": index, key: content, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

    def chunk(self, index: int, delta: str, finish: str | None, usage_tokens: int | None = None) -> dict:
        """One streamed event; the last one carries the usage of every choice."""
        chunk = {
            "id": self.id,
            "object": self.object + (".chunk" if self.chat else ""),
            "created": self.created,
            "model": self.model,
            "choices": [self.choice(index, delta, finish, True)],
        }
        if usage_tokens is not None:
            chunk["usage"] = self.usage(usage_tokens)
        return chunk

    def whole(self, choices: list[tuple[str, str]], completion_tokens: int) -> dict:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [self.choice(i, text, finish, False) for i, (text, finish) in enumerate(choices)],
            "usage": self.usage(completion_tokens),
        }
