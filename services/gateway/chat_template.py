"""DeepSeek-V3.1's chat template (the format of DeepSeek's current API), rendered straight to ids.

Layout (the model's own tokenizer_config.json template; `T` is "</think>" in non-thinking mode and
"<think>" in thinking mode):

    <｜begin▁of▁sentence｜>{system prompts, joined by "\n\n"}[\n\n## Tools ... (with tools)]
    <｜User｜>{user text}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>
    <｜User｜>{user text}<｜Assistant｜></think>{text}<｜tool▁calls▁begin｜>
        <｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>...
        <｜tool▁calls▁end｜><｜end▁of▁sentence｜>
    <｜tool▁output▁begin｜>{tool result}<｜tool▁output▁end｜>      <- the model continues right here
    {answer after the tool results}<｜end▁of▁sentence｜>
    <｜User｜>{user text}<｜Assistant｜>T                           <- generation prompt

Each text is tokenized on its own and the special tokens are inserted as ids. Since special tokens
split the template's string anyway, this gives the same ids as tokenizing the rendered string,
except that text looking like a special token stays text. It also makes the rendering
prefix-stable by construction: turn N+1's ids start with turn N's prompt ids, then the answer's
ids (the gateway remembers the ids the model generated for each answer text, tool-call name and
arguments), which is what lets the KV cache of turn N serve turn N+1. Two exceptions, both the
template's own: every system message goes to the front (adding one mid-conversation changes the
prompt's beginning), and an earlier turn's reasoning is dropped (its "<think>" becomes "</think>"),
so in thinking mode the cache keeps the previous prompt but not the previous answer.
"""
from __future__ import annotations

import json
from typing import Iterable, NamedTuple

from services.gateway.token_cache import TenantTokenCache, TokenCache

ROLES = ("system", "user", "assistant", "tool")
SYSTEM_PROMPT_SEPARATOR = "\n\n"
TOOLS_HEADER = "## Tools\nYou have access to the following tools:\n"
TOOLS_FOOTER = (
    "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n<｜tool▁calls▁begin｜>"
    "<｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>"
    "{{additional_tool_calls}}<｜tool▁calls▁end｜>\n\nWhere:\n\n- `tool_call_name` must be an exact "
    "match to one of the available tools\n- `tool_call_arguments` must be valid JSON that strictly "
    "follows the tool's Parameters Schema\n- For multiple tool calls, chain them directly without "
    "separators or spaces\n")
# Token-cache roles of the texts the model generates; their remembered ids are re-sent as they are.
TOOL_NAME_ROLE = "tool_name"
TOOL_ARGUMENTS_ROLE = "tool_arguments"


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class ChatMessage(NamedTuple):
    role: str                          # one of ROLES
    text: str                          # content with text parts already joined
    tool_calls: tuple[ToolCall, ...] = ()  # assistant only
    prefix: bool = False               # the last assistant message, to be continued


def tools_prompt(tools: Iterable[dict]) -> str:
    """The system prompt's tool section without its fixed footer (TOOLS_FOOTER, whose tool-call
    tokens are special tokens): each tool as JSON, as the template's `tool | tojson` does."""
    return TOOLS_HEADER + "".join(json.dumps(tool, ensure_ascii=False) for tool in tools)


def render_chat(messages: Iterable[ChatMessage], cache: TokenCache | TenantTokenCache,
                tools: str = "", thinking: bool = False) -> list[int]:
    """Prompt ids for `messages`: the generation prompt after a user turn, nothing after tool
    results (the model goes on), nothing after an assistant prefix (the model continues it).
    `tools` is tools_prompt(...) or "" (no tools); its text is the client's, so it stays text."""
    messages = list(messages)
    special, template = cache.tokenizer.special, cache.tokenizer.template
    # All system messages, wherever they appear, form one system prompt right after bos.
    system_prompt = SYSTEM_PROMPT_SEPARATOR.join(m.text for m in messages if m.role == "system")
    if tools:
        system_prompt += SYSTEM_PROMPT_SEPARATOR + tools
    turns = [m for m in messages if m.role != "system"]
    items = [("system", system_prompt)] + [(m.role, m.text) for m in turns]
    for message in turns:
        for call in message.tool_calls:
            items += [(TOOL_NAME_ROLE, call.name), (TOOL_ARGUMENTS_ROLE, call.arguments)]
    encoded = iter(cache.encode_many(items))
    tokens = [special.bos]
    tokens.extend(next(encoded))
    if tools:
        tokens.extend(cache.tokenizer.encode_template_text(TOOLS_FOOTER))
    texts = [next(encoded) for _ in turns]
    after_user = False
    for message, ids in zip(turns, texts):
        if message.role == "user":
            tokens.append(special.user)
            tokens.extend(ids)
            after_user = True
        elif message.role == "tool":
            tokens += [template.tool_output_begin, *ids, template.tool_output_end]
            after_user = False
        elif message.role == "assistant":
            if after_user:
                tokens += _assistant_start(special.assistant, template, message.prefix and thinking)
            tokens.extend(ids)
            for index, _call in enumerate(message.tool_calls):
                if index == 0:
                    tokens.append(template.tool_calls_begin)
                tokens += [template.tool_call_begin, *next(encoded), template.tool_sep, *next(encoded),
                           template.tool_call_end]
            if message.tool_calls:
                tokens.append(template.tool_calls_end)
            if not message.prefix:
                tokens.append(special.eos)
            after_user = False
        else:
            raise ValueError(f"unknown chat role {message.role!r}")
    if after_user:
        tokens += _assistant_start(special.assistant, template, thinking)
    return tokens


def _assistant_start(assistant: int, template, thinking: bool) -> list[int]:
    """<｜Assistant｜> then <think> (thinking) or </think>; a tokenizer without </think> (DeepSeek-V3's
    first template, V2's vocabulary) gets <｜Assistant｜> alone, as its own template writes it."""
    mark = template.think_begin if thinking else template.think_end
    return [assistant] if mark is None else [assistant, mark]


def render_completion(prompt: str, cache: TokenCache | TenantTokenCache) -> list[int]:
    """Prompt ids for the raw-text /v1/completions endpoint: bos, then the text as text."""
    return [cache.tokenizer.special.bos] + cache.encode("prompt", prompt)


def render_fill_in_middle(prompt: str, suffix: str, cache: TokenCache | TenantTokenCache) -> list[int]:
    """DeepSeek's FIM layout: bos <｜fim▁begin｜>{prefix}<｜fim▁hole｜>{suffix}<｜fim▁end｜>; the model
    writes the middle."""
    template = cache.tokenizer.template
    prefix_ids, suffix_ids = cache.encode_many([("prompt", prompt), ("suffix", suffix)])
    return [cache.tokenizer.special.bos, template.fim_begin, *prefix_ids, template.fim_hole,
            *suffix_ids, template.fim_end]
