"""POST /v1/responses on the demo server, through the official openai client: text (whole and streamed as typed
events, each valid against the client's own types), usage, incomplete at max_output_tokens, forced function calls,
text.format json_schema, previous_response_id, and 400s in OpenAI's error shape naming the field."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import TypeAdapter

from chat_like import named_events, templated_length
from conftest import API_KEY, AUTH
from frontend.api.errors import APIError
from frontend.api.responses_output import ResponseStore, StoredResponse
from launch.shipped import DEMO_CHAT_PROMPT, DEMO_MODEL_NAME

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}
EVENTS = TypeAdapter(ResponseStreamEvent)
LOGPROBS = "message.output_text.logprobs"
# A valid one-pixel PNG: the demo model reads text only.
RED_PIXEL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAA"
             "AElFTkSuQmCC")


@pytest.fixture(scope="module")
def demo(demo_server):
    """The demo server with an API key, keeping two responses: (base URL, openai client)."""
    return demo_server, openai.OpenAI(base_url=f"{demo_server}/v1", api_key=API_KEY, max_retries=0)


def prompt_length(messages: list[dict], tools: list[dict] | None = None) -> int:
    """The templated conversation's length, its Responses tools in chat form."""
    return templated_length(messages, [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                                       for t in tools or []])


def _stream(base_url: str, body: dict) -> list[dict]:
    """The events of a streamed response, each valid (strictly) against the openai client's types, numbered."""
    events = named_events(f"{base_url}/v1/responses", AUTH, body)
    for number, event in enumerate(events):
        assert event["sequence_number"] == number
        EVENTS.validate_python(event, strict=True)
    return events


def test_text_whole_and_streamed_with_usage_and_the_length_limit(demo):
    base_url, client = demo
    asked = dict(model=DEMO_MODEL_NAME, input=DEMO_CHAT_PROMPT, instructions="Answer in Python.",
                 max_output_tokens=64, temperature=0)
    response = client.responses.create(**asked)
    expected = prompt_length([{"role": "system", "content": "Answer in Python."},
                              {"role": "user", "content": DEMO_CHAT_PROMPT}])
    assert response.usage.input_tokens == expected and 0 < response.usage.output_tokens <= 64
    assert response.usage.total_tokens == expected + response.usage.output_tokens
    if response.usage.output_tokens == 64:
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None
    assert response.output_text and response.model == DEMO_MODEL_NAME and response.instructions == "Answer in Python."
    raw = httpx.post(f"{base_url}/v1/responses", headers=AUTH, json=asked, timeout=120).json()
    Response.model_validate(raw, strict=True)
    assert raw["output"][0]["content"][0]["text"] == response.output_text

    events = _stream(base_url, asked)
    kinds = [event["type"] for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{response.status}"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == response.output_text
    final = events[-1]["response"]
    assert final["usage"] == raw["usage"] and final["output"][0]["content"] == raw["output"][0]["content"]
    streamed = list(client.responses.create(**asked, stream=True))  # the client reads the same events
    assert streamed[-1].response.output_text == response.output_text


@pytest.mark.parametrize("tool_choice, parallel", [({"type": "function", "name": "get_weather"}, True),
                                                   ("required", False)])
def test_a_forced_tool_choice_makes_exactly_one_valid_call(demo, tool_choice, parallel):
    base_url, client = demo
    asked = dict(model=DEMO_MODEL_NAME, input="Weather in Paris?", tools=[WEATHER, TIME], tool_choice=tool_choice,
                 parallel_tool_calls=parallel, max_output_tokens=64, temperature=0)
    response = client.responses.create(**asked)
    assert response.status == "completed"
    assert response.usage.input_tokens == prompt_length([{"role": "user", "content": "Weather in Paris?"}],
                                                        [WEATHER, TIME])
    [call] = response.output
    schemas = {"get_weather": WEATHER["parameters"], "get_time": TIME["parameters"]}
    assert call.type == "function_call" and call.call_id and call.name in schemas
    jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    if isinstance(tool_choice, dict):
        assert call.name == "get_weather"
    events = _stream(base_url, asked)
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert (done["arguments"], events[-1]["response"]["output"][0]["name"]) == (call.arguments, call.name)

    # The call's output goes back as input items: through the template as the call and a tool message.
    follow_up = client.responses.create(model=DEMO_MODEL_NAME, tools=[WEATHER, TIME], tool_choice="none",
                                        max_output_tokens=4, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow_up.usage.input_tokens == prompt_length([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": json.loads(call.arguments)}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}], [WEATHER, TIME])


def test_text_format_json_schema_gives_valid_json(demo):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    response = demo[1].responses.create(model=DEMO_MODEL_NAME, input="Is 2 even?", max_output_tokens=64,
                                        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema}})
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), schema)


def test_previous_response_id_continues_the_stored_conversation(demo):
    client = demo[1]
    *_, done = client.responses.create(model=DEMO_MODEL_NAME, input="Hello", instructions="Be brief.",
                                       max_output_tokens=8, stream=True)  # a streamed response is stored too
    first = done.response
    second = client.responses.create(model=DEMO_MODEL_NAME, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=8, store=False)
    # The instructions are not carried over (OpenAI's rule); the earlier turns are.
    assert second.usage.input_tokens == prompt_length([{"role": "user", "content": "Hello"},
                                                       {"role": "assistant", "content": first.output_text},
                                                       {"role": "user", "content": "And then?"}])
    assert second.previous_response_id == first.id
    for _ in range(2):  # --max-stored-responses 2: the first is dropped
        client.responses.create(model=DEMO_MODEL_NAME, input="x", max_output_tokens=1)
    for unknown in ("resp_unknown", second.id, first.id):  # never made, made with store false, dropped
        with pytest.raises(openai.NotFoundError) as raised:
            client.responses.create(model=DEMO_MODEL_NAME, input="x", previous_response_id=unknown)
        assert raised.value.body["param"] == "previous_response_id"


def test_stored_responses_are_retrieved_listed_and_deleted(demo):
    base_url, client = demo
    turns = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "input_text", "text": "Hi"}]}, {"role": "assistant", "content": "Hello!"}, {"role": "user",
                                                                                        "content": "Bye"}]
    created = client.responses.create(model=DEMO_MODEL_NAME, input=turns, max_output_tokens=4)
    raw = httpx.get(f"{base_url}/v1/responses/{created.id}", headers=AUTH, timeout=60).json()
    Response.model_validate(raw, strict=True)
    assert client.responses.retrieve(created.id) == created

    listed = httpx.get(f"{base_url}/v1/responses/{created.id}/input_items", headers=AUTH, timeout=60).json()
    ResponseItemList.model_validate(listed, strict=True)
    assert [(item["role"], item["content"][0]["text"]) for item in listed["data"]] == [
        ("user", "Bye"), ("assistant", "Hello!"), ("user", "Hi"), ("developer", "Be brief.")]  # last sent first
    assert (listed["first_id"], listed["last_id"], listed["has_more"]) == (listed["data"][0]["id"],
                                                                           listed["data"][-1]["id"], False)
    paged = client.responses.input_items.list(created.id, limit=1, order="asc")  # the client follows `after`
    assert len(paged.data) == 1 and [item.id for item in paged] == [item["id"] for item in listed["data"][::-1]]

    *_, done = client.responses.create(model=DEMO_MODEL_NAME, input="Hello", max_output_tokens=4, stream=True)
    assert client.responses.retrieve(done.response.id) == done.response  # a streamed response is stored whole
    assert client.responses.delete(done.response.id) is None
    not_stored = client.responses.create(model=DEMO_MODEL_NAME, input="x", max_output_tokens=1, store=False)
    for gone in (done.response.id, not_stored.id, "resp_unknown"):  # deleted, made with store false, never made
        with pytest.raises(openai.NotFoundError) as raised:
            client.responses.retrieve(gone)
        assert raised.value.body["param"] == "response_id" and raised.value.body["code"] == "response_not_found"
        for method, path in (("DELETE", ""), ("GET", "/input_items"), ("POST", "/cancel")):
            answer = httpx.request(method, f"{base_url}/v1/responses/{gone}{path}", headers=AUTH, timeout=60)
            assert answer.status_code == 404 and answer.json()["error"]["param"] == "response_id"
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(created.id)
    bad_page = httpx.get(f"{base_url}/v1/responses/{created.id}/input_items?limit=0", headers=AUTH, timeout=60)
    assert bad_page.status_code == 400 and bad_page.json()["error"]["param"] == "limit"


def test_logprobs_on_output_text_equal_chat_completions(demo):
    base_url, client = demo
    asked = dict(model=DEMO_MODEL_NAME, input=DEMO_CHAT_PROMPT, max_output_tokens=12, temperature=0,
                 include=[LOGPROBS], top_logprobs=3)
    response = client.responses.create(**asked)
    chat = client.chat.completions.create(model=DEMO_MODEL_NAME, max_completion_tokens=12,
                                          messages=[{"role": "user", "content": DEMO_CHAT_PROMPT}], temperature=0,
                                          logprobs=True, top_logprobs=3)
    [part] = response.output[0].content
    expected = [token.model_dump() for token in chat.choices[0].logprobs.content]
    assert part.text == chat.choices[0].message.content and len(expected) == response.usage.output_tokens
    assert [token.model_dump() for token in part.logprobs] == expected and response.top_logprobs == 3
    assert all(len(token["top_logprobs"]) == 3 for token in expected)

    events = _stream(base_url, asked)
    deltas = [token for e in events if e["type"] == "response.output_text.delta" for token in e["logprobs"]]
    [done] = [e["logprobs"] for e in events if e["type"] == "response.output_text.done"]
    assert deltas == done == events[-1]["response"]["output"][0]["content"][0]["logprobs"] == expected
    plain = client.responses.create(**{**asked, "include": None, "top_logprobs": None})
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == part.text


def test_the_store_keeps_the_most_recently_used_responses():
    store = ResponseStore(2)
    first = StoredResponse([{"role": "user", "content": "1"}], {"id": "a"}, [])
    store.put("a", first)
    store.put("b", StoredResponse([], {}, []))
    store.get("a")
    store.put("c", StoredResponse([], {}, []))
    assert store.get("a") is first and store.get("c").conversation == []
    with pytest.raises(APIError) as raised:
        store.get("b")
    assert raised.value.status == 404 and raised.value.param == "previous_response_id"
    store.delete("a")
    with pytest.raises(APIError) as raised:
        store.delete("a")
    assert raised.value.status == 404 and raised.value.param == "response_id"
    empty = ResponseStore(0)
    empty.put("a", first)
    assert not empty.responses


@pytest.mark.parametrize("extra, param, message", [
    ({"input": 5}, "input", "valid"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.role", "'user'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": RED_PIXEL}]}]},
     "input", "does not accept images"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.content.0.type", "files are not supported"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id", "needs call_id"),
    ({"n": 2}, "n", "one output per response"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "only function tools"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not among the tools"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "needs name and schema"),
    ({"top_logprobs": 2}, "top_logprobs", "needs include"),
    ({"include": [LOGPROBS], "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"include": ["reasoning.encrypted_content"]}, "include.0", LOGPROBS),
    ({"background": True}, "background", "not supported"),
])
def test_bad_bodies_are_400s_naming_the_field(demo, extra, param, message):
    response = httpx.post(f"{demo[0]}/v1/responses", headers=AUTH, timeout=60,
                          json={"model": DEMO_MODEL_NAME, "input": "Hi", **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"
