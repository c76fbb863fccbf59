"""Chat messages as chat templates take them: text content, tool calls with their arguments as objects."""
from __future__ import annotations

import json

from frontend.api.errors import APIError
from frontend.api.protocol import ChatMessage


def template_message(message: ChatMessage) -> dict:
    """A message as chat templates take it: tool calls' arguments as objects where they parse (as transformers'
    templates expect), a tool answer with its call id."""
    result: dict = {"role": message.role, "content": _message_text(message.content)}
    if message.tool_calls:
        result["tool_calls"] = [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
            for call in message.tool_calls]
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        result["name"] = message.name
    return result


def _arguments(text: str) -> dict | str:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _message_text(content: str | list[dict] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "only text content parts are supported", "messages")
        parts.append(part["text"])
    return "\n".join(parts)

