"""POST /v1/messages (Anthropic's Messages API) on the chat path: its request as a chat request, the chat answer
as a message (whole, or as Anthropic's stream events), refusals in Anthropic's error shape; and count_tokens, the
length of the prompt a messages request would send."""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from frontend.api.chat_adapter import chat_request, error_route, rename_param
from frontend.api.errors import APIError
from frontend.api.messages_output import (error_response, message_object, new_message_id, stop_reason,
                                          tool_use_block)
from frontend.api.messages_protocol import Message, MessagesPrompt, MessagesRequest, OutputConfig, ToolChoice
from frontend.api.messages_stream import MessageEvents
from frontend.api.responses import ChatCompletionResponse
from frontend.api.route_errors import cancel_on_disconnect
from frontend.api.serving import OpenAIServing

# The chat request's fields as this API names them, for the errors the chat path raises.
_RENAMED = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens", "response_format": "output_config"}


def add_messages_routes(app: FastAPI, serving: OpenAIServing) -> None:
    router = APIRouter(route_class=error_route(error_response))

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, _answer(serving, body))

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: MessagesPrompt) -> dict:
        """The prompt's tokens as the chat template renders it: system, messages and tools."""
        chat = chat_request(prompt_fields(body), _RENAMED)
        serving.adapters.resolve(chat.model)
        try:
            _, prompt = await asyncio.to_thread(serving.chat_prompt, chat)
        except APIError as error:
            raise rename_param(error, _RENAMED) from None
        return {"input_tokens": len(prompt["prompt_token_ids"])}

    app.include_router(router)


async def _answer(serving: OpenAIServing, body: MessagesRequest) -> Response:
    chat = chat_request(chat_fields(body), _RENAMED)
    message_id = new_message_id()
    try:
        result = await serving.chat_result(chat, lambda head, prompts: MessageEvents(
            message_id, head["model"], prompts[0].num_prompt_tokens))
    except APIError as error:
        raise rename_param(error, _RENAMED) from None
    if not isinstance(result, ChatCompletionResponse):
        return result
    [choice] = result.choices
    text, calls = choice.message.content, choice.message.tool_calls
    content = ([{"type": "text", "text": text}] if text else []) + [tool_use_block(call) for call in calls]
    return JSONResponse(message_object(message_id, result.model, content,
                                       stop_reason(choice.finish_reason, choice.stop_reason),
                                       result.usage.prompt_tokens, result.usage.completion_tokens))


def chat_fields(body: MessagesRequest) -> dict:
    """The chat request's fields: the prompt's, and how to sample the answer."""
    fields = {"max_tokens": body.max_tokens, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
              "stop": body.stop_sequences, "stream": body.stream,
              "stream_options": {"include_usage": True} if body.stream else None}
    return prompt_fields(body) | {name: value for name, value in fields.items() if value is not None}


def prompt_fields(body: MessagesPrompt) -> dict:
    """The chat request's fields that make the prompt: the system prompt as the first message, the tools as chat
    functions (and the tool choice and output format, which constrain the answer)."""
    system = body.system if isinstance(body.system, str) or body.system is None else "\n".join(
        block.text for block in body.system)
    messages = [] if not system else [{"role": "system", "content": system}]
    for position, message in enumerate(body.messages):
        messages += chat_messages(message, f"messages.{position}")
    fields = {"model": body.model, "messages": messages,
              "tools": [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                          "parameters": tool.input_schema}}
                        for tool in body.tools] if body.tools else None,
              "tool_choice": None if body.tool_choice is None else _chat_tool_choice(body.tool_choice),
              "parallel_tool_calls": body.tool_choice is None or not body.tool_choice.disable_parallel_tool_use,
              "response_format": _response_format(body.output_config)}
    return {name: value for name, value in fields.items() if value is not None}


def _response_format(config: OutputConfig | None) -> dict | None:
    if config is None or config.format is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": config.format.schema_}}


def _chat_tool_choice(choice: ToolChoice) -> str | dict:
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_messages(message: Message, where: str) -> list[dict]:
    """One message as chat messages: a user's tool_result blocks as tool messages (before its text), an assistant's
    tool_use blocks as its tool_calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results = [], [], []  # texts: the text and image parts, in order
    for position, block in enumerate(message.content):
        if block.type in ("tool_use", "tool_result") and message.role != _ROLE_OF[block.type]:
            raise APIError(400, f"{block.type} blocks belong in {_ROLE_OF[block.type]} messages",
                           f"{where}.content.{position}.type")
        if block.type == "text":
            texts.append({"type": "text", "text": block.text})
        elif block.type == "image":
            texts.append({"type": "image_url", "image_url": {"url": block.source.chat_url()}})
        elif block.type == "tool_use":
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        else:
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.result_text()})
    if message.role == "assistant":
        return [{"role": "assistant", "content": texts or None, "tool_calls": calls or None}]
    return results + ([{"role": "user", "content": texts}] if texts or not results else [])


_ROLE_OF = {"tool_use": "assistant", "tool_result": "user"}
