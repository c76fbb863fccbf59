"""OpenAI tool calling: which tool choice a request makes, the structured-output constraint that makes the model
write valid calls, and the tool_calls read back from what it wrote."""
from __future__ import annotations

import json
from typing import Any

from frontend.api.errors import APIError
from frontend.api.protocol import ChatCompletionRequest, NamedToolChoice
from frontend.api.tool_parsers import CALL_CONSTRAINTS, TOOL_CALL_PARSERS, ParsedOutput, tool_call
from ipc import StructuredOutputsParams

_ANY_OBJECT = {"type": "object"}


def tool_mode(body: ChatCompletionRequest, parser: str | None) -> str | None:
    """"required", a function's name (both forced by a constraint), "auto" (the model's own calls, read by
    `parser`), or None (text only); a 400 for a choice this server cannot serve."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    if choice is None or choice == "auto":  # OpenAI's default with tools is "auto"
        if parser is None:
            raise APIError(400, 'tool_choice "auto" (the default when tools are given) needs the server started '
                                'with --enable-auto-tool-choice --tool-call-parser NAME; or ask for "required", '
                                'a named function, or "none"', "tool_choice")
        return "auto"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {tool.function.name for tool in body.tools}:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                           "tool_choice")
        return choice.function.name
    return "required"


def tool_constraint(body: ChatCompletionRequest, mode: str, parser: str | None = None
                    ) -> StructuredOutputsParams | None:
    """The constraint of a tool choice. With a parser that has one, calls in the model's own format (see
    CALL_CONSTRAINTS); else OpenAI's forms: a named function, its arguments object; "required", a list of
    {"name", "parameters"} calls; "auto", none. One call unless parallel_tool_calls."""
    parameters = {tool.function.name: tool.function.parameters or _ANY_OBJECT for tool in body.tools}
    if parser in CALL_CONSTRAINTS:
        named = mode not in ("auto", "required")
        tag = CALL_CONSTRAINTS[parser]({mode: parameters[mode]} if named else parameters, mode != "auto",
                                       named or not body.parallel_tool_calls)
        return StructuredOutputsParams(structural_tag=json.dumps(tag, ensure_ascii=False))
    if mode == "auto":
        return None
    if mode != "required":
        return StructuredOutputsParams(json=parameters[mode])
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in parameters.items()]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def read_tool_calls(mode: str, parser: str | None, text: str) -> ParsedOutput:
    """(content, OpenAI tool_calls) of a finished output."""
    if mode == "auto" or parser in CALL_CONSTRAINTS:
        return TOOL_CALL_PARSERS[parser][0](text)
    if mode != "required":
        return None, [tool_call(mode, text)]
    return None, [tool_call(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
                  for call in json.loads(text)]


def template_tools(body: ChatCompletionRequest) -> list[dict] | None:
    """The tools as chat templates take them (transformers' `tools=`)."""
    return [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
