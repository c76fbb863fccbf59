"""OpenAI's Responses API on the chat path: POST /v1/responses (its request as a chat request, the chat answer as
a response, whole or as typed events, conversations continued by previous_response_id) and the stored responses'
routes (GET and DELETE /v1/responses/{id}, its input_items, cancel)."""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Literal

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from frontend.api.chat_adapter import chat_request, error_route, rename_param
from frontend.api.errors import APIError
from frontend.api.responses import ChatCompletionResponse
from frontend.api.responses_items import input_items, item_page
from frontend.api.responses_output import (ResponseHead, ResponseStore, StoredResponse, assistant_message,
                                           output_items, response_object, response_status, response_usage)
from frontend.api.responses_protocol import InputItem, ResponsesRequest
from frontend.api.responses_stream import ResponseEvents
from frontend.api.route_errors import cancel_on_disconnect
from frontend.api.serving import OpenAIServing

DEFAULT_MAX_STORED_RESPONSES = 1000
# The chat request's fields as this API names them, for the errors the chat path raises.
_RENAMED = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
            "response_format": "text"}


def add_responses_routes(app: FastAPI, serving: OpenAIServing,
                         max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
    store = ResponseStore(max_stored_responses)
    router = APIRouter(route_class=error_route(APIError.response))

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, _respond(serving, store, body))

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict:
        return store.get(response_id, "response_id").response

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict:
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @router.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, after: str | None = None, limit: int = Query(20, ge=1, le=100),
                               order: Literal["asc", "desc"] = "desc") -> dict:
        return item_page(store.get(response_id, "response_id").input_items, after, limit, order)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> dict:
        store.get(response_id, "response_id")
        raise APIError(400, "only a response made with background true can be cancelled, and this server runs none "
                            "in the background: each ends with its request (close the connection to cancel it)",
                       "response_id")

    app.include_router(router)


async def _respond(serving: OpenAIServing, store: ResponseStore, body: ResponsesRequest) -> Response:
    history = store.get(body.previous_response_id).conversation if body.previous_response_id is not None else []
    given, origins = input_messages(body.input)
    conversation = history + given
    earlier = len(history) + (body.instructions is not None)
    try:
        chat = chat_request(chat_fields(body, conversation), {})
    except APIError as error:
        raise input_param(error, earlier, origins) from None
    head = ResponseHead(f"resp_{uuid.uuid4().hex}", int(time.time()), body)
    items = input_items(body.input) if body.store else []

    def remember(response: dict, text: str | None, calls: list[dict]) -> dict:
        if body.store:
            store.put(head.id, StoredResponse(conversation + [assistant_message(text, calls)], response, items))
        return response

    try:
        result = await serving.chat_result(chat, lambda chunk, _: ResponseEvents(
            dataclasses.replace(head, model=chunk["model"]), remember))
    except APIError as error:
        raise input_param(error, earlier, origins) from None
    if not isinstance(result, ChatCompletionResponse):
        return result
    [choice] = result.choices
    output = output_items(choice.message.content, choice.message.tool_calls, choice.finish_reason, choice.logprobs)
    response = response_object(dataclasses.replace(head, model=result.model), output,
                               response_status(choice.finish_reason), response_usage(result.usage.model_dump()))
    return JSONResponse(remember(response, choice.message.content, choice.message.tool_calls))


def chat_fields(body: ResponsesRequest, conversation: list[dict]) -> dict:
    """The chat request's fields: the instructions (never carried to a later response) as the system message."""
    system = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    tool_choice = body.tool_choice
    if tool_choice is not None and not isinstance(tool_choice, str):
        tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
    fields = {"model": body.model, "messages": system + conversation, "max_completion_tokens": body.max_output_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
              "stream_options": {"include_usage": True} if body.stream else None, "tool_choice": tool_choice,
              "tools": [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                        for tool in body.tools] if body.tools else None,
              "parallel_tool_calls": body.parallel_tool_calls,
              "logprobs": body.logprobs or None, "top_logprobs": body.top_logprobs,
              "response_format": body.text.format.response_format() if body.text and body.text.format else None}
    return {name: value for name, value in fields.items() if value is not None}


def input_messages(given: str | list[InputItem]) -> tuple[list[dict], list[int]]:
    """`input` as chat messages, and the input item each message starts with: a function call joins the assistant
    message before it (or starts one), and a call's output is a tool message."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}], [0]
    messages: list[dict] = []
    origins: list[int] = []
    for position, item in enumerate(given):
        if item.type == "function_call" and messages and messages[-1]["role"] == "assistant":
            messages[-1]["tool_calls"] = [*(messages[-1].get("tool_calls") or []), _call(item)]
            continue
        origins.append(position)
        if item.type == "message":
            content = item.content if isinstance(item.content, str) else [part.chat_part() for part in item.content]
            messages.append({"role": item.role, "content": content})
        elif item.type == "function_call":
            messages.append({"role": "assistant", "content": None, "tool_calls": [_call(item)]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages, origins


def _call(item: InputItem) -> dict:
    return {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}


def input_param(error: APIError, earlier: int, origins: list[int]) -> APIError:
    """`error` naming the field as this request sent it: the chat path's messages.K (the `earlier` messages are the
    instructions' and previous_response_id's, the rest stand for the input items `origins` lists) as input.N, an
    image part's image_url.url as its image_url."""
    head, _, rest = (error.param or "").partition(".")
    index, _, inner = rest.partition(".")
    if head != "messages" or not index.isdigit():
        return rename_param(error, _RENAMED)
    number = int(index) - earlier
    param = "previous_response_id" if number < 0 else ".".join(
        ["input", str(origins[number])] + ([inner.removesuffix(".url")] if inner else []))
    if error.message.startswith(f"{error.param}:"):
        error.message = param + error.message[len(error.param):]
    error.param = param
    return error
