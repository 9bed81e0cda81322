"""Response bodies and stream chunks in the OpenAI wire format, with DeepSeek's cache usage."""
from __future__ import annotations

from typing import NamedTuple


class Usage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache

    def body(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_cache_hit_tokens": self.cached_tokens,
            "prompt_cache_miss_tokens": self.prompt_tokens - self.cached_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class ResponseHeader(NamedTuple):
    """Fields every body and chunk of one response repeats."""
    id: str
    created: int  # unix seconds
    model: str


def chat_completion(header: ResponseHeader, text: str, finish_reason: str, usage: Usage) -> dict:
    return {"id": header.id, "object": "chat.completion", "created": header.created,
            "model": header.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage.body()}


def chat_chunk(header: ResponseHeader, delta: dict, finish_reason: str | None = None,
               usage: Usage | None = None, include_usage_field: bool = False) -> dict:
    chunk = {"id": header.id, "object": "chat.completion.chunk", "created": header.created,
             "model": header.model,
             "choices": [{"index": 0, "delta": delta, "logprobs": None,
                          "finish_reason": finish_reason}]}
    if usage is not None or include_usage_field:
        chunk["usage"] = usage.body() if usage is not None else None
    return chunk


def text_completion(header: ResponseHeader, text: str, finish_reason: str | None,
                    usage: Usage | None = None, include_usage_field: bool = True) -> dict:
    body = {"id": header.id, "object": "text_completion", "created": header.created,
            "model": header.model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}]}
    if usage is not None or include_usage_field:
        body["usage"] = usage.body() if usage is not None else None
    return body


def usage_chunk(header: ResponseHeader, obj: str, usage: Usage) -> dict:
    """OpenAI's stream_options.include_usage chunk: no choices, only usage."""
    return {"id": header.id, "object": obj, "created": header.created, "model": header.model,
            "choices": [], "usage": usage.body()}


def models_list(model: str, created: int) -> dict:
    return {"object": "list",
            "data": [{"id": model, "object": "model", "created": created, "owned_by": "deepinfer"}]}
