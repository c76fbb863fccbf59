"""A chat stream's chunks as the Responses API's typed events: response.created, output items with their text
deltas or function-call arguments, then response.completed (or .incomplete)."""
from __future__ import annotations

from collections.abc import Callable

from frontend.api.chat_adapter import named_event
from frontend.api.errors import APIError
from frontend.api.responses_output import (ResponseHead, call_item, message_item, new_message_id, response_object,
                                           response_status, response_usage, text_part)


class ResponseEvents:
    """The ChunkWriter of one streamed response (one choice). `on_done(response, text, calls)` hears its finished
    answer: the final response object, its text and its calls."""

    def __init__(self, head: ResponseHead, on_done: Callable[[dict, str, list[dict]], None]) -> None:
        self.head, self.on_done = head, on_done
        self.sequence_number = 0
        self.output: list[dict] = []  # the finished items
        self.message_id: str | None = None  # the message item being written, if one is
        self.text, self.all_text = "", ""
        self.logprobs: list[dict] = []  # the message's tokens' logprobs (when asked), as far as its deltas carry them
        self.pending: list[dict] = []  # those of tokens whose text has not come yet (a stop string held it back)
        self.calls: list[dict] = []
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def chunk(self, chunk: dict) -> bytes:
        if chunk.get("usage") is not None:  # the last chunk: its counts go in the final response
            self.usage = response_usage(chunk["usage"])
            return b""
        response = response_object(self.head, [], "in_progress", None)
        return self._event("response.created", response=response) + self._event("response.in_progress",
                                                                                 response=response)

    def choice(self, choice: dict) -> bytes:
        delta, events = choice["delta"], b""
        if choice.get("logprobs"):
            self.pending += choice["logprobs"]["content"]
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls", ()):
            events += self._close_message("completed") + self._call(call)
        if choice["finish_reason"] is not None:
            self.finish_reason = choice["finish_reason"]
            events += self._close_message(response_status(self.finish_reason))
        return events

    def end(self) -> bytes:
        status = response_status(self.finish_reason)
        response = response_object(self.head, self.output, status, self.usage)
        self.on_done(response, self.all_text, self.calls)
        return self._event(f"response.{status}", response=response)

    def error(self, error: APIError) -> bytes:
        return self._event("error", code=error.code, message=error.message, param=error.param)

    def _text(self, text: str) -> bytes:
        events = b""
        if self.message_id is None:
            self.message_id, self.text, self.logprobs = new_message_id(), "", []
            events += self._event("response.output_item.added", output_index=len(self.output),
                                  item=message_item(self.message_id, "", "in_progress") | {"content": []})
            events += self._event("response.content_part.added", **self._where(), part=text_part(""))
        self.text += text
        self.all_text += text
        return events + self._delta(text)

    def _delta(self, text: str) -> bytes:
        logprobs, self.pending = self.pending, []
        self.logprobs += logprobs
        return self._event("response.output_text.delta", **self._where(), delta=text, logprobs=logprobs)

    def _close_message(self, status: str) -> bytes:
        if self.message_id is None:
            return b""
        events = self._delta("") if self.pending else b""  # the last tokens' logprobs, though they wrote no text
        item = message_item(self.message_id, self.text, status, self.logprobs)
        events += (self._event("response.output_text.done", **self._where(), text=self.text, logprobs=self.logprobs)
                   + self._event("response.content_part.done", **self._where(),
                                 part=text_part(self.text, self.logprobs))
                   + self._event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self.message_id = None
        return events

    def _call(self, call: dict) -> bytes:
        """A call comes whole (the chat path sends each at the end): its events all at once."""
        self.calls.append({name: value for name, value in call.items() if name != "index"})
        item, index = call_item(call), len(self.output)
        events = (self._event("response.output_item.added", output_index=index,
                              item={**item, "arguments": "", "status": "in_progress"})
                  + self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=item["arguments"])
                  + self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=item["arguments"])
                  + self._event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return events

    def _where(self) -> dict:
        return {"item_id": self.message_id, "output_index": len(self.output), "content_index": 0}

    def _event(self, kind: str, **fields: object) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return named_event(kind, body)
