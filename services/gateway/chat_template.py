"""DeepSeek-V3's chat template, rendered straight to token ids.

Layout (the model's own tokenizer_config.json template, without tool calls):

    <｜begin▁of▁sentence｜>{system prompts, joined by "\n\n"}
    <｜User｜>{user text}<｜Assistant｜>{answer}<｜end▁of▁sentence｜>
    <｜User｜>{user text}<｜Assistant｜>            <- generation prompt

Each message's text is tokenized on its own and the special tokens are inserted as ids. Since
special tokens split the template's string anyway, this gives the same ids as tokenizing the
rendered string, except that text looking like a special token stays text. It also makes the
rendering prefix-stable by construction: turn N+1's ids start with turn N's prompt ids, then the
answer's ids, then <｜end▁of▁sentence｜>, which is what lets the KV cache of turn N serve turn N+1.
(As in DeepSeek's template, every system message goes to the front: adding one mid-conversation
changes the prompt's beginning, and with it every cached block.)
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

from services.gateway.token_cache import TenantTokenCache, TokenCache

ROLES = ("system", "user", "assistant")
SYSTEM_PROMPT_SEPARATOR = "\n\n"


class ChatMessage(NamedTuple):
    role: str  # one of ROLES
    text: str  # content with text parts already joined


def render_chat(messages: Iterable[ChatMessage], cache: TokenCache | TenantTokenCache) -> list[int]:
    """Prompt ids for `messages`, ending with the generation prompt <｜Assistant｜>."""
    messages = list(messages)
    special = cache.tokenizer.special
    # All system messages, wherever they appear, form one system prompt right after bos.
    system_prompt = SYSTEM_PROMPT_SEPARATOR.join(m.text for m in messages if m.role == "system")
    turns = [m for m in messages if m.role != "system"]
    encoded = cache.encode_many([("system", system_prompt)] + [(m.role, m.text) for m in turns])
    tokens = [special.bos]
    tokens.extend(encoded[0])
    for message, ids in zip(turns, encoded[1:]):
        if message.role == "user":
            tokens.append(special.user)
            tokens.extend(ids)
        elif message.role == "assistant":
            tokens.append(special.assistant)
            tokens.extend(ids)
            tokens.append(special.eos)
        else:
            raise ValueError(f"unknown chat role {message.role!r}")
    tokens.append(special.assistant)
    return tokens


def render_completion(prompt: str, cache: TokenCache | TenantTokenCache) -> list[int]:
    """Prompt ids for the raw-text /v1/completions endpoint: bos, then the text as text."""
    return [cache.tokenizer.special.bos] + cache.encode("prompt", prompt)
