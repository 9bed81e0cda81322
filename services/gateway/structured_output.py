"""Tools, tool_choice and response_format: parsed, checked, and turned into the engine's grammar.

The engine constrains decoding with llguidance (a token mask per step). The gateway sends it one of
{"type": "json_object"}, {"type": "json_schema", "schema": ...} or, for a forced tool call,
{"type": "lark", "grammar": ...}: a Lark grammar over DeepSeek-V3.1's tool-call tokens (referenced
by id, `<[128806]>`) whose arguments are the tool's JSON schema (`%json {...}`). So a call forced by
tool_choice "required" or a named function always parses and matches its schema. With "auto" the
model decides freely whether to call; its call is parsed but not constrained.
"""
from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

import jsonschema

from services.gateway.openai_errors import invalid
from services.gateway.tokenizer import TemplateTokens

MAX_TOOLS = 128  # as OpenAI
FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# The arguments are written without free whitespace, as the model's template shows them.
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class Tool(NamedTuple):
    name: str
    parameters: dict      # JSON schema of the arguments
    definition: dict      # the tool as the client sent it (rendered into the system prompt)


class ToolChoice(NamedTuple):
    mode: str             # "none" | "auto" | "required" | "function"
    name: str | None = None


def _object(value: Any, param: str) -> dict:
    if not isinstance(value, dict):
        raise invalid(param, f"Invalid type for '{param}': expected an object.", "invalid_type")
    return value


def _schema(value: Any, param: str) -> dict:
    schema = _object(value, param)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as error:
        raise invalid(param, f"Invalid '{param}': not a valid JSON Schema ({error.message}).",
                      "invalid_value") from None
    return schema


def parse_tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid("tools", "Invalid type for 'tools': expected an array.", "invalid_type")
    if len(value) > MAX_TOOLS:
        raise invalid("tools", f"Invalid 'tools': at most {MAX_TOOLS} tools.", "invalid_value")
    tools, names = [], set()
    for index, tool in enumerate(value):
        param = f"tools[{index}]"
        _object(tool, param)
        if tool.get("type") != "function":
            raise invalid(f"{param}.type", f"Invalid '{param}.type': only 'function' is supported.",
                          "invalid_value")
        function = _object(tool.get("function"), f"{param}.function")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise invalid(f"{param}.function.name", f"Invalid '{param}.function.name': expected a "
                          "name of 1-64 letters, digits, '_' or '-'.", "invalid_value")
        if name in names:
            raise invalid(f"{param}.function.name", f"Invalid '{param}.function.name': "
                          f"{name!r} is defined twice.", "invalid_value")
        names.add(name)
        for field in set(function) - {"name", "description", "parameters", "strict"}:
            raise invalid(f"{param}.function.{field}", f"Unrecognized field '{param}.function.{field}'.",
                          "unknown_parameter")
        for field in set(tool) - {"type", "function"}:
            raise invalid(f"{param}.{field}", f"Unrecognized field '{param}.{field}'.", "unknown_parameter")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise invalid(f"{param}.function.description", f"Invalid type for '{param}.function."
                          "description': expected a string.", "invalid_type")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise invalid(f"{param}.function.strict", f"Invalid type for '{param}.function.strict': "
                          "expected a boolean.", "invalid_type")
        parameters = function.get("parameters")
        parameters = EMPTY_PARAMETERS if parameters is None else _schema(
            parameters, f"{param}.function.parameters")
        tools.append(Tool(name, parameters, tool))
    return tuple(tools)


def parse_tool_choice(value: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise invalid("tool_choice", "Invalid 'tool_choice': expected 'none', 'auto', 'required' "
                          "or {\"type\": \"function\", \"function\": {\"name\": ...}}.", "invalid_value")
        choice = ToolChoice(value)
    else:
        _object(value, "tool_choice")
        function = value.get("function")
        if value.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise invalid("tool_choice", "Invalid 'tool_choice': expected 'none', 'auto', 'required' "
                          "or {\"type\": \"function\", \"function\": {\"name\": ...}}.", "invalid_value")
        if function["name"] not in {tool.name for tool in tools}:
            raise invalid("tool_choice", f"Invalid 'tool_choice': no tool named {function['name']!r} "
                          "in 'tools'.", "invalid_value")
        choice = ToolChoice("function", function["name"])
    if choice.mode in ("required", "function") and not tools:
        raise invalid("tool_choice", "Invalid 'tool_choice': 'required' or a named function needs "
                      "'tools'.", "invalid_value")
    return choice


def parse_response_format(value: Any) -> dict | None:
    """The engine grammar for `response_format`, or None for plain text."""
    if value is None:
        return None
    _object(value, "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise invalid("response_format.type", "Invalid 'response_format.type': expected 'text', "
                      "'json_object' or 'json_schema'.", "invalid_value")
    spec = _object(value.get("json_schema"), "response_format.json_schema")
    if not isinstance(spec.get("name"), str) or not FUNCTION_NAME.match(spec["name"]):
        raise invalid("response_format.json_schema.name", "Invalid 'response_format.json_schema.name': "
                      "expected a name of 1-64 letters, digits, '_' or '-'.", "invalid_value")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise invalid("response_format.json_schema.strict", "Invalid type for "
                      "'response_format.json_schema.strict': expected a boolean.", "invalid_type")
    schema = spec.get("schema")
    schema = {"type": "object"} if schema is None else _schema(schema, "response_format.json_schema.schema")
    # Decoding is constrained whether or not strict is set: the output always matches.
    return {"type": "json_schema", "schema": schema}


def tool_call_grammar(tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool,
                      template: TemplateTokens) -> dict:
    """The Lark grammar forcing one call of the named tool, or under "required" one call (with
    parallel_tool_calls, one or more) of any tool, in the V3.1 layout:
    <｜tool▁calls▁begin｜>(<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>)+<｜tool▁calls▁end｜>"""
    allowed = [tool for tool in tools if choice.mode != "function" or tool.name == choice.name]
    parallel = parallel and choice.mode == "required"
    lines = [f"start: <[{template.tool_calls_begin}]> call{'+' if parallel else ''} "
             f"<[{template.tool_calls_end}]>",
             f"call: <[{template.tool_call_begin}]> ({' | '.join(f'f{i}' for i in range(len(allowed)))}) "
             f"<[{template.tool_call_end}]>"]
    for index, tool in enumerate(allowed):
        schema = dict(tool.parameters)
        schema["x-guidance"] = _COMPACT_JSON
        lines.append(f"f{index}: {json.dumps(tool.name)} <[{template.tool_sep}]> a{index}")
        lines.append(f"a{index}: %json {json.dumps(schema, ensure_ascii=False)}")
    return {"type": "lark", "grammar": "\n".join(lines) + "\n"}
