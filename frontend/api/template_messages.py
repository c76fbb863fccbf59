"""Chat messages as chat templates take them: text content (image parts as placeholders), tool calls with their
arguments as objects."""
from __future__ import annotations

import json

from frontend.api.errors import APIError
from frontend.api.protocol import ChatMessage


def template_message(message: ChatMessage) -> dict:
    """A message as chat templates take it: tool calls' arguments as objects where they parse (as transformers'
    templates expect), a tool answer with its call id."""
    result: dict = {"role": message.role, "content": _message_content(message.content)}
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


def _message_content(content: str | list[dict] | None) -> str | list[dict]:
    """The text parts joined; with an image among them, the parts in order as multimodal templates take them
    ({"type": "text", "text": ...} and {"type": "image"}: the image itself travels beside the prompt)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") == "image_url":
            parts.append({"type": "image"})
        elif part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise APIError(400, "content parts are text or image_url parts", "messages")
    if any(part["type"] == "image" for part in parts):
        return parts
    return "\n".join(part["text"] for part in parts)

