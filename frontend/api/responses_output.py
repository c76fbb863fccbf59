"""What a Responses API response is: its object (whole, and as its stream's events carry it), its output items, and
the store that previous_response_id reads."""
from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from frontend.api.errors import APIError
from frontend.api.responses_protocol import ResponsesRequest

# Stored conversations keep their images as sent (a data: URL is the encoded image): this bounds what they hold.
DEFAULT_MAX_STORED_IMAGE_BYTES = 256 * 2**20


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
            "truncation": "disabled", "metadata": body.metadata or {}, "usage": usage,
            "top_logprobs": body.top_logprobs}


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


def message_item(item_id: str, text: str, status: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [text_part(text, logprobs)]}


def text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    """An output_text part; `logprobs` are its tokens' in chat's per-token shape, which is also this API's."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(call: dict, status: str = "completed") -> dict:
    """A chat tool call as a function_call item; its call id stays the chat call's."""
    function = call["function"]
    return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
            "name": function["name"], "arguments": function["arguments"], "status": status}


def output_items(text: str | None, calls: list[dict], finish_reason: str | None,
                 logprobs: dict | None = None) -> list[dict]:
    """A finished chat message (with its chat logprobs, if asked) as the output: its text (when it wrote any), then
    its calls."""
    status = response_status(finish_reason)
    items = [message_item(new_message_id(), text, status, logprobs and logprobs["content"])] if text else []
    return items + [call_item(call) for call in calls]


def assistant_message(text: str | None, calls: list[dict]) -> dict:
    """An answer as the chat message a later response's conversation holds."""
    return {"role": "assistant", "content": text or None, "tool_calls": calls or None}


@dataclass
class StoredResponse:
    """What the store keeps of a response: the conversation a later one continues, the response object and its
    input items (as GET /v1/responses/{id} and its input_items return them)."""

    conversation: list[dict]
    response: dict
    input_items: list[dict]
    image_bytes: int = field(init=False)  # its conversation's image URLs' characters (its input items share them)

    def __post_init__(self) -> None:
        self.image_bytes = sum(len(part["image_url"]["url"]) for message in self.conversation
                               if isinstance(message.get("content"), list)
                               for part in message["content"] if part.get("type") == "image_url")


class ResponseStore:
    """The stored responses (made with store true), read by previous_response_id and GET: at most `capacity`, whose
    image URLs (a data: URL is its image, encoded) come to at most `max_image_bytes`, the least recently used dropped
    first (0: none are stored). A response continued from another counts the images it carries on again, though the
    two share them: the bound errs on the safe side. Each gateway process has its own."""

    def __init__(self, capacity: int, max_image_bytes: int = DEFAULT_MAX_STORED_IMAGE_BYTES) -> None:
        self.capacity, self.max_image_bytes = capacity, max_image_bytes
        self.responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self.image_bytes = 0

    def get(self, response_id: str, param: str = "previous_response_id") -> StoredResponse:
        """The stored response; a 404 naming `param` (the field that gave the id) for an unknown or dropped id."""
        stored = self.responses.get(response_id)
        if stored is None:
            raise APIError(404, f"{param} {response_id!r}: no stored response has this id (stored: the "
                                f"{self.capacity} most recently used responses made with store true, within "
                                f"{self.max_image_bytes} bytes of image URLs)", param, code="response_not_found")
        self.responses.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep `stored`, dropping the least recently used over the bounds; one whose images alone are over the byte
        bound is not kept."""
        if self.capacity <= 0 or stored.image_bytes > self.max_image_bytes:
            return
        self._drop(response_id)
        self.responses[response_id] = stored
        self.image_bytes += stored.image_bytes
        while len(self.responses) > self.capacity or self.image_bytes > self.max_image_bytes:
            self._drop(next(iter(self.responses)))

    def delete(self, response_id: str) -> None:
        self.get(response_id, "response_id")
        self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        if (dropped := self.responses.pop(response_id, None)) is not None:
            self.image_bytes -= dropped.image_bytes
