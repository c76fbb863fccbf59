"""POST /v1/messages on the demo server, through the official anthropic client: text (whole and streamed, every
event valid against the client's own types), usage, max_tokens and stop_sequence ends, forced tool use and
tool_result turns through the template, x-api-key and Bearer, and 400s in Anthropic's error shape."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from chat_like import named_events, templated_length
from conftest import API_KEY
from launch.shipped import DEMO_CHAT_PROMPT, DEMO_MODEL_NAME

WEATHER = {"name": "get_weather", "description": "Weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"], "additionalProperties": False}}
TIME = {"name": "get_time", "input_schema": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in (WEATHER, TIME)}
EVENTS = TypeAdapter(RawMessageStreamEvent)
HEADERS = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
GREEDY = {"temperature": 0}  # an Anthropic field the newest clients no longer name: sent as an extra


@pytest.fixture(scope="module")
def demo(demo_server):
    """The demo server with an API key: (base URL, anthropic client)."""
    return demo_server, anthropic.Anthropic(base_url=demo_server, api_key=API_KEY, max_retries=0)


def prompt_length(messages: list[dict], tools: list[dict] | None = None) -> int:
    """The templated conversation's length, its Anthropic tools in chat form."""
    return templated_length(messages, [{"type": "function", "function": {
        "name": t["name"], **({"description": t["description"]} if "description" in t else {}),
        "parameters": t["input_schema"]}} for t in tools or []])


def _stream(base_url: str, body: dict) -> list[dict]:
    """The events of a streamed message, each valid (strictly) against the anthropic client's types."""
    events = named_events(f"{base_url}/v1/messages", HEADERS, body)
    for event in events:
        EVENTS.validate_python(event, strict=True)
    return events


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_text_whole_and_streamed_with_usage_max_tokens_and_stop_sequences(demo):
    base_url, client = demo
    asked = dict(model=DEMO_MODEL_NAME, max_tokens=64, system="Answer in Python.",
                 messages=[{"role": "user", "content": DEMO_CHAT_PROMPT}])
    message = client.messages.create(**asked, extra_body=GREEDY)
    expected = prompt_length([{"role": "system", "content": "Answer in Python."},
                              {"role": "user", "content": DEMO_CHAT_PROMPT}])
    assert message.usage.input_tokens == expected and 0 < message.usage.output_tokens <= 64
    assert message.stop_reason == ("max_tokens" if message.usage.output_tokens == 64 else "end_turn")
    text = _text(message)
    assert text and message.model == DEMO_MODEL_NAME and message.stop_sequence is None
    raw = httpx.post(f"{base_url}/v1/messages", headers=HEADERS, json={**asked, **GREEDY}, timeout=120).json()
    Message.model_validate(raw, strict=True)
    assert raw["content"] == [{"type": "text", "text": text}]

    events = _stream(base_url, {**asked, **GREEDY})
    assert [e["type"] for e in events[:2]] == ["message_start", "content_block_start"]
    assert [e["type"] for e in events[-3:]] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["usage"]["input_tokens"] == expected
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == text
    with client.messages.stream(**asked, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (_text(final), final.stop_reason, final.usage.output_tokens) == (text, message.stop_reason,
                                                                            message.usage.output_tokens)

    stop = text[10:13]  # a piece of the greedy answer: the same answer stops where it first appears
    cut = client.messages.create(**asked, stop_sequences=["NEVER", stop], extra_body=GREEDY)
    assert (cut.stop_reason, cut.stop_sequence, _text(cut)) == ("stop_sequence", stop, text[:text.index(stop)])
    with client.messages.stream(**asked, stop_sequences=[stop], extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, _text(final)) == ("stop_sequence", stop, _text(cut))


@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "get_weather"},
                                         {"type": "any", "disable_parallel_tool_use": True}])
def test_a_forced_tool_choice_makes_exactly_one_valid_tool_use(demo, tool_choice):
    base_url, client = demo
    asked = dict(model=DEMO_MODEL_NAME, max_tokens=64, tools=[WEATHER, TIME], tool_choice=tool_choice,
                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    message = client.messages.create(**asked, extra_body=GREEDY)
    assert message.stop_reason == "tool_use"
    assert message.usage.input_tokens == prompt_length([{"role": "user", "content": "Weather in Paris?"}],
                                                       [WEATHER, TIME])
    [call] = message.content
    assert call.type == "tool_use" and call.id and call.name in SCHEMAS
    jsonschema.validate(call.input, SCHEMAS[call.name])
    if tool_choice["type"] == "tool":
        assert call.name == "get_weather"
    events = _stream(base_url, {**asked, **GREEDY})
    assert [e["type"] for e in events] == ["message_start", "content_block_start", "content_block_delta",
                                           "content_block_stop", "message_delta", "message_stop"]
    assert json.loads(events[2]["delta"]["partial_json"]) == call.input
    with client.messages.stream(**asked, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content] == [(call.name, call.input)] and final.stop_reason == "tool_use"

    cut = client.messages.create(**asked, stop_sequences=['"'], extra_body=GREEDY)  # a call cut short stays text
    assert cut.stop_reason == "stop_sequence" and [block.type for block in cut.content] == ["text"]

    # The tool's result goes back as a tool_result block: through the template as the call and a tool message.
    follow_up = client.messages.create(model=DEMO_MODEL_NAME, max_tokens=4, tools=[WEATHER, TIME],
                                       tool_choice={"type": "none"}, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}])
    assert follow_up.usage.input_tokens == prompt_length([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.name, "arguments": call.input}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}], [WEATHER, TIME])


def test_output_config_json_schema_gives_valid_json(demo):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    message = demo[1].messages.create(model=DEMO_MODEL_NAME, max_tokens=64, output_config={"format": {
        "type": "json_schema", "schema": schema}}, messages=[{"role": "user", "content": "Is 2 even?"}])
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(_text(message)), schema)


def test_the_key_goes_as_x_api_key_or_bearer(demo):
    base_url, client = demo
    hello = dict(model=DEMO_MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert client.messages.create(**hello).usage.output_tokens > 0  # the anthropic client sends x-api-key
    bearer = httpx.post(f"{base_url}/v1/messages", json=hello, headers={"Authorization": f"Bearer {API_KEY}"})
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0).messages.create(**hello)
    assert openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0).models.list().data


def test_count_tokens_is_the_prompt_a_messages_call_reports(demo):
    base_url, client = demo
    body = dict(model=DEMO_MODEL_NAME, system="Answer briefly.", tools=[WEATHER, TIME],
                tool_choice={"type": "tool", "name": "get_time"}, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris", "days": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                     {"type": "text", "text": "And the time?"}]}])
    counted = client.messages.count_tokens(**body)
    message = client.messages.create(**body, max_tokens=2)
    assert counted.input_tokens == message.usage.input_tokens
    plain = client.messages.count_tokens(model=DEMO_MODEL_NAME, messages=[{"role": "user", "content": "Hi"}])
    assert plain.input_tokens == prompt_length([{"role": "user", "content": "Hi"}]) < counted.input_tokens
    refused = httpx.post(f"{base_url}/v1/messages/count_tokens", headers=HEADERS, timeout=60,
                         json={"model": DEMO_MODEL_NAME, "messages": []})
    assert refused.status_code == 400 and refused.json()["error"]["message"].startswith("messages")
    unknown = httpx.post(f"{base_url}/v1/messages/count_tokens", headers=HEADERS, timeout=60,
                         json={"model": "nope", "messages": [{"role": "user", "content": "Hi"}]})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("extra, field, message", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AA=="}}]}]},
     "messages.0.content.0.source.media_type", "needs media_type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "A"}}]}]},
     "messages.0.content.0.type", "documents are not supported"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, "messages.0.role", "'user' or 'assistant'"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages.0.content.0.type", "belong in user messages"),
    ({"max_tokens": None}, "max_tokens", "Field required"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking", "not supported"),
    ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools.0.input_schema", '"type": "object"'),
    ({"tools": [TIME], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice", "not among the tools"),
    ({"stop_sequences": ["a", ""]}, "stop_sequences.1", "at least 1 character"),
])
def test_bad_bodies_are_400s_in_anthropics_shape_naming_the_field(demo, extra, field, message):
    body = {"model": DEMO_MODEL_NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **extra}
    response = httpx.post(f"{demo[0]}/v1/messages", headers=HEADERS, timeout=60,
                          json={name: value for name, value in body.items() if value is not None})
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(field) and message in error["message"]


def test_a_body_that_is_not_json_is_a_400_in_anthropics_shape(demo):
    response = httpx.post(f"{demo[0]}/v1/messages", headers={**HEADERS, "content-type": "application/json"},
                          content=b'{"model": ', timeout=60)
    assert response.status_code == 400 and response.json()["type"] == "error"
    assert response.json()["error"]["message"].startswith("the request body is not valid JSON")
