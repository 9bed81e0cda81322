"""The model's token ids -> the reply's channels: reasoning, content and tool calls.

DeepSeek-V3.1 writes a reply as

    [reasoning </think>] content [<｜tool▁calls▁begin｜>
        (<｜tool▁call▁begin｜>name<｜tool▁sep｜>arguments<｜tool▁call▁end｜>)+ <｜tool▁calls▁end｜>]

(reasoning only in thinking mode, whose prompt ends with <think>). The parser works on ids, not text:
a tool-call token is a structure mark only when it is the id itself, never when the text spells
it. Without tools (or with tool_choice "none") tool-call ids are plain text, as any other id.
Each channel has its own incremental detokenizer, so every delta is whole UTF-8 characters.
Stop strings apply to the content only. Reasoning reaches the client as `reasoning_content`.
"""
from __future__ import annotations

from typing import NamedTuple

from services.gateway.chat_template import ToolCall
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.tokenizer import DeepSeekTokenizer

REASONING, CONTENT, BETWEEN_CALLS, NAME, ARGUMENTS, CALLS_DONE = range(6)


class ToolCallDelta(NamedTuple):
    index: int
    id: str | None = None         # with the name, on the call's first delta
    name: str | None = None
    arguments: str = ""


class ReplyDelta(NamedTuple):
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class ParsedCall(NamedTuple):
    call: ToolCall
    name_ids: list[int]
    argument_ids: list[int]


class ReplyParser:
    def __init__(self, tokenizer: DeepSeekTokenizer, stops: tuple[str, ...], thinking: bool,
                 parse_tool_calls: bool, call_id_prefix: str, parallel_tool_calls: bool = True,
                 engine_ends_calls: bool = False):
        self._template = tokenizer.template
        self._tokenizer = tokenizer
        self._stops = StopStringMatcher(stops)
        self._content = IncrementalDetokenizer(tokenizer)
        self._reasoning = IncrementalDetokenizer(tokenizer)
        self._arguments = IncrementalDetokenizer(tokenizer)
        self._tools = parse_tool_calls
        self._call_id_prefix = call_id_prefix
        self._parallel = parallel_tool_calls  # False: the reply ends after its first call
        # A forced call's grammar ends the generation itself (and its done event reports the usage);
        # an unconstrained reply is stopped here once its calls are over.
        self._stop_after_calls = not engine_ends_calls
        self.state = REASONING if thinking else CONTENT
        self.content_ids: list[int] = []      # the ids of the content text, for the next turn
        self.calls: list[ParsedCall] = []     # complete calls
        self.stopped = False                  # a stop string or the end of the tool calls: stop generating
        self.stopped_by_string = False
        self._name_ids: list[int] = []
        self._argument_ids: list[int] = []
        self._argument_text: list[str] = []

    def push(self, token_id: int) -> tuple[ReplyDelta, bool]:
        """The delta this token completes, and whether it is a content token (its logprob is reported)."""
        template, state = self._template, self.state
        if state == REASONING:
            if token_id == template.think_end:
                self.state = CONTENT
                return ReplyDelta(reasoning=self._reasoning.finish()), False
            return ReplyDelta(reasoning=self._reasoning.push(token_id)), False
        if state == CONTENT:
            if self._tools and token_id == template.tool_calls_begin:
                self.state = BETWEEN_CALLS
                return self._finish_content(), False
            self.content_ids.append(token_id)
            scan = self._stops.push(self._content.push(token_id))
            if scan.stopped:
                self.stopped = self.stopped_by_string = True
            return ReplyDelta(content=scan.text), True
        if state == BETWEEN_CALLS:
            if token_id == template.tool_call_begin:
                self.state, self._name_ids = NAME, []
            elif token_id == template.tool_calls_end:
                self.state, self.stopped = CALLS_DONE, self._stop_after_calls
            return ReplyDelta(), False  # anything else between calls is not part of a call
        if state == NAME:
            if token_id != template.tool_sep:
                self._name_ids.append(token_id)
                return ReplyDelta(), False
            self.state, self._argument_ids, self._argument_text = ARGUMENTS, [], []
            index = len(self.calls)
            name = self._tokenizer.decode(self._name_ids)
            return ReplyDelta(tool_calls=(ToolCallDelta(index, self._call_id(index), name),)), False
        if state == ARGUMENTS:
            index = len(self.calls)
            if token_id == template.tool_call_end:
                text = self._arguments.finish()
                self._argument_text.append(text)
                self.calls.append(ParsedCall(
                    ToolCall(self._call_id(index), self._tokenizer.decode(self._name_ids),
                             "".join(self._argument_text)), self._name_ids, self._argument_ids))
                self.state = BETWEEN_CALLS if self._parallel else CALLS_DONE
                self.stopped = self._stop_after_calls and not self._parallel
                return ReplyDelta(tool_calls=(ToolCallDelta(index, arguments=text),) if text else ()), False
            self._argument_ids.append(token_id)
            text = self._arguments.push(token_id)
            self._argument_text.append(text)
            return ReplyDelta(tool_calls=(ToolCallDelta(index, arguments=text),) if text else ()), False
        return ReplyDelta(), False  # after <｜tool▁calls▁end｜>: the engine is being stopped

    def finish(self) -> ReplyDelta:
        """What the detokenizers and the stop matcher still hold at the end of generation."""
        if self.state == REASONING:
            return ReplyDelta(reasoning=self._reasoning.finish())
        if self.state == CONTENT and not self.stopped:
            return self._finish_content()
        if self.state == ARGUMENTS:  # cut off mid-call (length): the call with the arguments so far, as streamed
            index = len(self.calls)
            text = self._arguments.finish()
            self._argument_text.append(text)
            self.calls.append(ParsedCall(
                ToolCall(self._call_id(index), self._tokenizer.decode(self._name_ids), "".join(self._argument_text)),
                self._name_ids, self._argument_ids))
            return ReplyDelta(tool_calls=(ToolCallDelta(index, arguments=text),) if text else ())
        return ReplyDelta()

    @property
    def in_tool_calls(self) -> bool:
        return self.state in (BETWEEN_CALLS, NAME, ARGUMENTS, CALLS_DONE)

    @property
    def calls_complete(self) -> bool:
        return self.state == CALLS_DONE

    def _finish_content(self) -> ReplyDelta:
        scan = self._stops.push(self._content.finish())
        if scan.stopped:
            self.stopped = self.stopped_by_string = True
            return ReplyDelta(content=scan.text)
        return ReplyDelta(content=scan.text + self._stops.finish())

    def _call_id(self, index: int) -> str:
        return f"call_{self._call_id_prefix}_{index}"
