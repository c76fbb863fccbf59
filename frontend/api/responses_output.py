"""What a Responses API response is: its object (whole, and as its stream's events carry it), its output items, and
the store that previous_response_id reads."""
from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass

from frontend.api.errors import APIError
from frontend.api.responses_protocol import ResponsesRequest


@dataclass(frozen=True)
class ResponseHead:
    """What a response says of itself before any output: its id, creation time, request and model."""

    id: str
    created_at: int
    request: ResponsesRequest
    model: str = ""


def response_object(head: ResponseHead, output: list[dict], status: str, usage: dict | None) -> dict:
    body = head.request
    text_format = body.text.format if body.text is not None and body.text.format is not None else None
    tool_choice = body.tool_choice or "auto"
    return {"id": head.id, "object": "response", "created_at": head.created_at, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": head.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                     else {"type": "text"}},
            "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "truncation": "disabled", "metadata": body.metadata or {}, "usage": usage}


def response_status(finish_reason: str | None) -> str:
    """A response cut by its token limit (or the context's end) is incomplete; any other end is complete."""
    return "incomplete" if finish_reason == "length" else "completed"


def response_usage(usage: dict) -> dict:
    """A chat usage as the Responses API counts it."""
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0,
                                                                             "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [text_part(text)]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict, status: str = "completed") -> dict:
    """A chat tool call as a function_call item; its call id stays the chat call's."""
    function = call["function"]
    return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
            "name": function["name"], "arguments": function["arguments"], "status": status}


def output_items(text: str | None, calls: list[dict], finish_reason: str | None) -> list[dict]:
    """A finished chat message as the output: its text (when it wrote any), then its calls."""
    status = response_status(finish_reason)
    items = [message_item(new_message_id(), text, status)] if text else []
    return items + [call_item(call) for call in calls]


def assistant_message(text: str | None, calls: list[dict]) -> dict:
    """An answer as the chat message a later response's conversation holds."""
    return {"role": "assistant", "content": text or None, "tool_calls": calls or None}


class ResponseStore:
    """The conversations of stored responses, read by previous_response_id: at most `capacity`, the least recently
    used dropped first (0: none are stored). Each gateway process has its own."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.conversations: OrderedDict[str, list[dict]] = OrderedDict()

    def get(self, response_id: str) -> list[dict]:
        conversation = self.conversations.get(response_id)
        if conversation is None:
            raise APIError(404, f"previous_response_id {response_id!r}: no stored response has this id (stored: the "
                                f"{self.capacity} most recently used responses made with store true)",
                           "previous_response_id", code="response_not_found")
        self.conversations.move_to_end(response_id)
        return conversation

    def put(self, response_id: str, conversation: list[dict]) -> None:
        if self.capacity <= 0:
            return
        self.conversations[response_id] = conversation
        while len(self.conversations) > self.capacity:
            self.conversations.popitem(last=False)
