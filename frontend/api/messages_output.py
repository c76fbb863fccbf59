"""What an Anthropic Messages API answer is: its content blocks, stop reason, usage and error shape."""
from __future__ import annotations

import json
import uuid

from fastapi.responses import JSONResponse

from frontend.api.errors import APIError

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_reason(finish_reason: str | None, matched: int | str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's end; `matched` is the stop string or token id it met."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def tool_use_block(call: dict) -> dict:
    """A chat tool call as a tool_use block; the arguments are a JSON object (tool schemas are objects)."""
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


def message_object(message_id: str, model: str, content: list[dict], stop: tuple[str | None, str | None],
                   input_tokens: int, output_tokens: int) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


def error_body(error: APIError) -> dict:
    """Anthropic's error shape; the message names the field at fault."""
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    message = error.message
    if error.param is not None and not message.startswith(error.param):
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status)
