"""OpenAI tool calling with tool_choice "required" or a named function: the structured-output constraint that
makes the model write valid calls, and the tool_calls read back from what it wrote."""
from __future__ import annotations

import json
import uuid
from typing import Any

from frontend.api.errors import APIError
from frontend.api.protocol import ChatCompletionRequest, NamedToolChoice
from ipc import StructuredOutputsParams

_ANY_OBJECT = {"type": "object"}


def forced_tool(body: ChatCompletionRequest) -> str | None:
    """"required", a function's name, or None when the model may answer in text; a 400 for what is not served."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    if choice is None or choice == "auto":  # OpenAI's default with tools is "auto"
        raise APIError(400, 'tool_choice "auto" (the default when tools are given) needs a tool-call parser, not '
                            'implemented yet: ask for "required", a named function, or "none"', "tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {tool.function.name for tool in body.tools}:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                           "tool_choice")
        return choice.function.name
    return "required"


def tool_constraint(body: ChatCompletionRequest, forced: str) -> StructuredOutputsParams:
    """A named function: its arguments object. "required": a list of {"name", "parameters"} calls, one of them
    unless parallel_tool_calls."""
    parameters = {tool.function.name: tool.function.parameters or _ANY_OBJECT for tool in body.tools}
    if forced != "required":
        return StructuredOutputsParams(json=parameters[forced])
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in parameters.items()]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def tool_calls(forced: str, text: str) -> list[dict]:
    """The OpenAI tool_calls of a finished output (arguments as JSON text, as OpenAI sends them)."""
    if forced != "required":
        return [_call(forced, text)]
    return [_call(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in json.loads(text)]


def template_tools(body: ChatCompletionRequest) -> list[dict] | None:
    """The tools as chat templates take them (transformers' `tools=`)."""
    return [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
