"""A response's input items as GET /v1/responses/{id}/input_items lists them: each with an id, a page at a time."""
from __future__ import annotations

import uuid

from frontend.api.errors import APIError
from frontend.api.responses_output import call_item, new_message_id
from frontend.api.responses_protocol import InputItem


def input_items(given: str | list[InputItem]) -> list[dict]:
    """`input` as the items the openai client reads back: messages (an assistant's as output messages), function
    calls and their outputs, in the order sent."""
    if isinstance(given, str):
        return [_message("user", given)]
    items = []
    for item in given:
        if item.type == "message":
            text = [item.content] if isinstance(item.content, str) else [part.text for part in item.content]
            items.append(_message(item.role, *text))
        elif item.type == "function_call":
            items.append(call_item({"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}))
        else:
            items.append({"type": "function_call_output", "id": f"fco_{uuid.uuid4().hex}", "call_id": item.call_id,
                          "output": item.output, "status": "completed"})
    return items


def _message(role: str, *texts: str) -> dict:
    if role == "assistant":
        content = [{"type": "output_text", "text": text, "annotations": []} for text in texts]
    else:
        content = [{"type": "input_text", "text": text} for text in texts]
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
