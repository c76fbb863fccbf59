"""tool_choice "auto": the hermes and llama3_json parsers find the calls a model wrote (and leave anything else as
text), a streamed answer shows its text until a call may begin, then the calls whole, and Hermes calls are kept
valid by a constraint that leaves the text free."""
from __future__ import annotations

import argparse
import json

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from frontend.api.chat_chunks import ToolReader
from frontend.api.cli_args import auto_tool_parser
from frontend.api.protocol import ChatCompletionRequest
from frontend.api.sampling import structured_outputs
from frontend.api.tool_parsers import held_back, parse_hermes, parse_llama3_json
from frontend.api.tools import read_tool_calls, tool_constraint, tool_mode


def _names_and_arguments(calls: list[dict]) -> list[tuple[str, dict]]:
    assert all(call["id"].startswith("call_") and call["type"] == "function" for call in calls)
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


def test_hermes_calls_and_the_text_around_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert _names_and_arguments(calls) == [("get_time", {"zone": "UTC"}),
                                           ("get_weather", {"city": "Oslo", "days": 2})]
    broken = 'Sure <tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>'
    assert parse_hermes(broken) == (broken, [])  # not a call: it stays text
    assert parse_hermes("plain answer") == ("plain answer", [])


def test_llama3_json_calls():
    content, calls = parse_llama3_json('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; '
                                       '{"name": "get_weather", "parameters": {"city": "Paris", "days": 1}}')
    assert content is None
    assert _names_and_arguments(calls) == [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Paris",
                                                                                            "days": 1})]
    for text in ("The answer is 4.", '{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": {}} trailing'):
        assert parse_llama3_json(text) == (text, [])


def test_held_back_stops_where_a_call_may_begin():
    assert held_back("Hello <tool", "<tool_call>") == len("Hello ")
    assert held_back("Hello <tool_call>{", "<tool_call>") == len("Hello ")
    assert held_back("Hello <b>", "<tool_call>") == len("Hello <b>")


@pytest.mark.parametrize("pieces, content, calls", [
    (["Let me ", "check. <tool", '_call>{"name": "get_time", ', '"arguments": {"zone": "UTC"}}</tool_call>'],
     "Let me check. ", [("get_time", {"zone": "UTC"})]),
    (["No tools ", "needed <", "b>."], "No tools needed <b>.", []),
])
def test_a_streamed_auto_answer_shows_text_then_the_calls_whole(pieces, content, calls):
    delta = ToolReader("auto", "hermes").stream(1)
    chunks = [delta(0, piece, "stop" if i == len(pieces) - 1 else None) for i, piece in enumerate(pieces)]
    shown = "".join(part.get("content", "") for part, _ in chunks)
    assert shown == content
    last, finish_reason = chunks[-1]
    if calls:
        assert finish_reason == "tool_calls"
        assert _names_and_arguments(last["tool_calls"]) == calls
        assert [call["index"] for call in last["tool_calls"]] == list(range(len(calls)))
    else:
        assert finish_reason == "stop" and "tool_calls" not in last


def test_auto_tool_choice_needs_a_parser():
    assert auto_tool_parser(argparse.Namespace(enable_auto_tool_choice=False, tool_call_parser=None)) is None
    assert auto_tool_parser(argparse.Namespace(enable_auto_tool_choice=True, tool_call_parser="hermes")) == "hermes"
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        auto_tool_parser(argparse.Namespace(enable_auto_tool_choice=True, tool_call_parser=None))


def test_hermes_calls_are_constrained_to_the_tools_and_their_schemas_forced_or_among_free_text_under_auto():
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
        for name in ("get_time", "get_date")]

    def grammar(tool_choice: object, **fields: object) -> xgrammar.Grammar:
        body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                     tool_choice=tool_choice, **fields)
        return xgrammar.Grammar.from_structural_tag(tool_constraint(body, tool_mode(body, "hermes"), "hermes")
                                                    .structural_tag)

    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    other = call.replace("get_time", "get_date")
    broken = (call.replace("get_time", "get_year"), call.replace("CET", "PST"), call[:-1] + "x")
    cases = {  # tool choice -> (accepted, refused)
        "auto": ((call, "Just text.", f"Let me check.\n{call}", f"{call}\n{other}"), broken),
        "required": ((call, f"{call}\n{other}"), ("Just text.", f"Let me check.\n{call}", *broken)),
        json.dumps({"type": "function", "function": {"name": "get_date"}}): ((other,), (call, f"{other}\n{other}")),
    }
    for choice, (accepted, refused) in cases.items():
        constrained = grammar(json.loads(choice) if choice.startswith("{") else choice)
        assert all(_is_grammar_accept_string(constrained, text) for text in accepted), choice
        assert not any(_is_grammar_accept_string(constrained, text) for text in refused), choice
    for choice in ("auto", "required"):
        assert not _is_grammar_accept_string(grammar(choice, parallel_tool_calls=False), f"{call}\n{other}")
    assert read_tool_calls("required", "hermes", f"{call}\n{other}")[1][1]["function"]["name"] == "get_date"
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools)
    assert tool_constraint(body, "auto", "llama3_json") is None  # its calls open with "{": not told from text
    assert json.loads(tool_constraint(body, "required", None).json)["type"] == "array"  # OpenAI's, no parser
    with_format = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                        response_format={"type": "json_object"})
    assert structured_outputs(with_format, "hermes").json_object  # the client's answer format wins over "auto"
