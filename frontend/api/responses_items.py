"""A response's input items as GET /v1/responses/{id}/input_items lists them: each with an id, a page at a time."""
from __future__ import annotations

import uuid

from frontend.api.errors import APIError
from frontend.api.responses_output import call_item, new_message_id
from frontend.api.responses_protocol import ContentPart, InputItem


def input_items(given: str | list[InputItem]) -> list[dict]:
    """`input` as the items the openai client reads back: messages (an assistant's as output messages), function
    calls and their outputs, in the order sent."""
    if isinstance(given, str):
        return [_message("user", [given])]
    items = []
    for item in given:
        if item.type == "message":
            items.append(_message(item.role, [item.content] if isinstance(item.content, str) else item.content))
        elif item.type == "function_call":
            items.append(call_item({"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}))
        else:
            items.append({"type": "function_call_output", "id": f"fco_{uuid.uuid4().hex}", "call_id": item.call_id,
                          "output": item.output, "status": "completed"})
    return items


def _message(role: str, parts: list[str | ContentPart]) -> dict:
    content = []
    for part in parts:
        if isinstance(part, ContentPart) and part.type == "input_image":  # its URL is the request's string, shared
            content.append({"type": "input_image", "image_url": part.image_url, "detail": part.detail,
                            "file_id": None})
        else:
            text = part if isinstance(part, str) else part.text
            content.append({"type": "output_text", "text": text, "annotations": []} if role == "assistant"
                           else {"type": "input_text", "text": text})
    return {"type": "message", "id": new_message_id(), "role": role, "status": "completed", "content": content}


def item_page(items: list[dict], after: str | None, limit: int, order: str) -> dict:
    """OpenAI's list of the `limit` items after the item `after` (none: from the first) in `order` ("desc": the
    last sent first)."""
    ordered = items[::-1] if order == "desc" else items
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise APIError(400, f"after {after!r}: this response has no input item with this id", "after")
        start = ids.index(after) + 1
    page = ordered[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(ordered)}
