"""A chat stream's chunks as the Messages API's events: message_start, content blocks (text_delta, or a tool_use's
input_json_delta), message_delta with the stop reason and usage, message_stop."""
from __future__ import annotations

from frontend.api.chat_adapter import named_event
from frontend.api.errors import APIError
from frontend.api.messages_output import error_body, message_object, stop_reason


class MessageEvents:
    """The ChunkWriter of one streamed message (one choice)."""

    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        self.message_id, self.model, self.input_tokens = message_id, model, input_tokens
        self.num_blocks = 0
        self.text_open = False
        self.stop: tuple[str, str | None] = ("end_turn", None)
        self.output_tokens = 0

    def chunk(self, chunk: dict) -> bytes:
        if chunk.get("usage") is not None:  # the last chunk
            self.output_tokens = chunk["usage"]["completion_tokens"]
            return b""
        message = message_object(self.message_id, self.model, [], (None, None), self.input_tokens, 0)
        return _event("message_start", message=message)

    def choice(self, choice: dict) -> bytes:
        delta, events = choice["delta"], b""
        if delta.get("content"):
            if not self.text_open:
                self.text_open = True
                events += _event("content_block_start", index=self.num_blocks,
                                 content_block={"type": "text", "text": ""})
            events += _event("content_block_delta", index=self.num_blocks,
                             delta={"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls", ()):
            events += self._close_text()
            function = call["function"]
            events += (_event("content_block_start", index=self.num_blocks,
                              content_block={"type": "tool_use", "id": call["id"], "name": function["name"],
                                             "input": {}})
                       + _event("content_block_delta", index=self.num_blocks,
                                delta={"type": "input_json_delta", "partial_json": function["arguments"]})
                       + _event("content_block_stop", index=self.num_blocks))
            self.num_blocks += 1
        if choice["finish_reason"] is not None:
            self.stop = stop_reason(choice["finish_reason"], choice.get("stop_reason"))
            events += self._close_text()
        return events

    def end(self) -> bytes:
        return (_event("message_delta", delta={"stop_reason": self.stop[0], "stop_sequence": self.stop[1]},
                       usage={"input_tokens": self.input_tokens, "output_tokens": self.output_tokens})
                + _event("message_stop"))

    def error(self, error: APIError) -> bytes:
        return named_event("error", error_body(error))

    def _close_text(self) -> bytes:
        if not self.text_open:
            return b""
        self.text_open = False
        self.num_blocks += 1
        return _event("content_block_stop", index=self.num_blocks - 1)


def _event(kind: str, **fields: object) -> bytes:
    return named_event(kind, {"type": kind, **fields})
