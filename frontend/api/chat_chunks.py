"""How a chat completion's text becomes its message and its stream chunks: the reasoning section and the tool
calls read from what the model wrote."""
from __future__ import annotations

import json
from collections.abc import Callable

from frontend.api.logprobs import chat_logprobs
from frontend.api.protocol import ChatCompletionRequest
from frontend.api.reasoning_parsers import ReasoningSplitter
from frontend.api.responses import ChatResponseMessage
from frontend.api.tool_parsers import TOOL_CALL_PARSERS, held_back
from frontend.api.tools import read_tool_calls
from frontend.outputs import RequestOutput


class ToolReader:
    """A chat request's tool calls, read from what the model wrote: forced ones (a constraint made the text a
    call) or, under "auto", whatever calls the parser finds."""

    def __init__(self, mode: str | None, parser: str | None) -> None:
        self.mode, self.parser = mode, parser
        self.marker = TOOL_CALL_PARSERS[parser][1] if mode == "auto" else ""

    def message(self, text: str | None, finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        """A finished choice's message, and its finish reason ("tool_calls" when it made calls); `text` is None
        when the answer was all reasoning."""
        if self.mode is None or finish_reason != "stop" or text is None:  # cut short: an unfinished call stays text
            return ChatResponseMessage(content=text), finish_reason
        try:
            content, calls = read_tool_calls(self.mode, self.parser, text)
            for call in calls:
                json.loads(call["function"]["arguments"])
        except ValueError:  # a forced call cut by a stop string, or never begun (the model stopped while thinking)
            return ChatResponseMessage(content=text), finish_reason
        if not calls:
            return ChatResponseMessage(content=text), finish_reason
        return ChatResponseMessage(content=content, tool_calls=calls), "tool_calls"

    def stream(self, n: int) -> Callable[[int, str, str | None], tuple[dict, str | None]]:
        """The delta parts of each choice's answer text as it streams, and its finish reason. Without tools the
        text as it comes; with them, text until a call may be starting (forced: from the first token), and each
        choice's calls whole in its last chunk, as delta.tool_calls the client library assembles as it does
        OpenAI's fragments."""
        texts, shown = [""] * n, [0] * n

        def delta(index: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
            if self.mode is None:
                return {"content": text}, finish_reason
            texts[index] += text
            if finish_reason is None:
                if self.mode != "auto":
                    return {}, None
                end = max(shown[index], held_back(texts[index], self.marker))
                part, shown[index] = texts[index][shown[index]:end], end
                return ({"content": part} if part else {}), None
            message, finish_reason = self.message(texts[index], finish_reason)
            if message.tool_calls:
                calls = [{"index": i, **call} for i, call in enumerate(message.tool_calls)]
                return {"tool_calls": calls}, finish_reason
            return {"content": texts[index][shown[index]:]}, finish_reason
        return delta


def chat_chunks(body: ChatCompletionRequest, tools: ToolReader,
                 reasoning_start: str | None) -> Callable[[int, RequestOutput], dict | None]:
    """The function that turns one choice's delta output into the choice of a chat chunk (None: nothing to show
    yet): its reasoning part (with a reasoning parser) as delta.reasoning_content, the rest through `tools`."""
    num_top = body.top_logprobs or 0
    splitters = None if reasoning_start is None else [ReasoningSplitter(reasoning_start) for _ in range(body.n)]
    answer = tools.stream(body.n)

    def choice(index: int, output: RequestOutput) -> dict | None:
        completion = output.outputs[0]
        reasoning, text = "", completion.text
        if splitters is not None:
            reasoning, text = splitters[index].feed(text)
            if completion.finish_reason is not None:
                rest_reasoning, rest_text = splitters[index].finish()
                reasoning, text = reasoning + rest_reasoning, text + rest_text
        delta, finish_reason = answer(index, text, completion.finish_reason)
        if splitters is not None and not delta.get("content", True):
            delta = {}  # nothing of the answer yet: a chunk only for the reasoning, the logprobs or the end
        if reasoning:
            delta = {"reasoning_content": reasoning, **delta}
        logprobs = chat_logprobs(completion, num_top) if tools.mode is None else None
        token_ids = completion.token_ids if body.return_token_ids else []
        if not delta and logprobs is None and finish_reason is None and not token_ids:
            return None
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if body.return_token_ids:  # vLLM's: the chunk's token ids, shown or not
            choice["token_ids"] = list(token_ids)
        if finish_reason is not None:  # vLLM's field: the stop string or token id that ended the choice
            choice["stop_reason"] = completion.stop_reason
        return choice
    return choice
