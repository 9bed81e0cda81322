"""Response bodies and stream chunks in the OpenAI wire format, with DeepSeek's cache usage."""
from __future__ import annotations

from typing import Iterable, NamedTuple

from services.gateway.tokenizer import DeepSeekTokenizer


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
    system_fingerprint: str | None = None  # the engine's model fingerprint, once an engine answers

    def fields(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint}


def _token_string(piece: bytes) -> str:
    """OpenAI's token string: the text, or "bytes:\\xe4\\xbd" for a piece that is not whole UTF-8."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in piece)


def chat_logprobs(entries: Iterable, tokenizer: DeepSeekTokenizer) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": None}."""
    def one(token_id: int, logprob: float) -> dict:
        piece = tokenizer.piece_bytes(token_id)
        return {"token": _token_string(piece), "logprob": logprob, "bytes": list(piece)}
    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries],
            "refusal": None}


def completion_logprobs(entries: Iterable, tokenizer: DeepSeekTokenizer, text_offset: int) -> dict:
    """The legacy shape: parallel lists, top_logprobs as {token: logprob}, offsets into the text."""
    tokens, logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for entry in entries:
        token = _token_string(tokenizer.piece_bytes(entry.token_id))
        tokens.append(token)
        logprobs.append(entry.logprob)
        tops.append({_token_string(tokenizer.piece_bytes(t)): lp for t, lp in entry.top})
        offsets.append(offset)
        offset += len(tokenizer.token_bytes(entry.token_id).decode("utf-8", "replace"))
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def tool_calls_body(calls) -> list[dict]:
    return [{"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}} for call in calls]


def tool_call_deltas(deltas) -> list[dict]:
    """OpenAI's streamed form: the first delta of a call carries id, type and name."""
    out = []
    for delta in deltas:
        item = {"index": delta.index}
        if delta.id is not None:
            item |= {"id": delta.id, "type": "function",
                     "function": {"name": delta.name, "arguments": delta.arguments}}
        else:
            item["function"] = {"arguments": delta.arguments}
        out.append(item)
    return out


def chat_completion(header: ResponseHeader, text: str, finish_reason: str, usage: Usage,
                    reasoning: str | None = None, tool_calls: list[dict] | None = None,
                    logprobs: dict | None = None) -> dict:
    message = {"role": "assistant", "content": text if text or not tool_calls else None}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {**header.fields("chat.completion"),
            "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                         "finish_reason": finish_reason}],
            "usage": usage.body()}


def chat_chunk(header: ResponseHeader, delta: dict, finish_reason: str | None = None,
               usage: Usage | None = None, include_usage_field: bool = False,
               logprobs: dict | None = None) -> dict:
    chunk = {**header.fields("chat.completion.chunk"),
             "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish_reason}]}
    if usage is not None or include_usage_field:
        chunk["usage"] = usage.body() if usage is not None else None
    return chunk


def text_completion(header: ResponseHeader, text: str, finish_reason: str | None,
                    usage: Usage | None = None, include_usage_field: bool = True,
                    logprobs: dict | None = None) -> dict:
    body = {**header.fields("text_completion"),
            "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}
    if usage is not None or include_usage_field:
        body["usage"] = usage.body() if usage is not None else None
    return body


def usage_chunk(header: ResponseHeader, obj: str, usage: Usage) -> dict:
    """OpenAI's stream_options.include_usage chunk: no choices, only usage."""
    return {**header.fields(obj), "choices": [], "usage": usage.body()}


def model_card(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "deepinfer"}


def models_list(models: Iterable[str], created: int) -> dict:
    return {"object": "list", "data": [model_card(model, created) for model in models]}
