"""Structured output: every constrained output satisfies its JSON schema, regex, choice or grammar; bad constraints
and slow ones fail their request alone; the gateway takes response_format, structured_outputs and guided_*."""
from __future__ import annotations

import ast
import datetime
import itertools
import json
import os
import re

import httpx
import jsonschema
import pytest
import torch

from conftest import AUTH, assert_all_blocks_free
from core.engine_core import EngineCore
from core.structured_output.formats import EXACT_FORMATS, with_exact_formats
from core.structured_output.routing import json_schema_backend
from frontend import LLM, SamplingParams, StructuredOutputsParams
from ipc import EngineConfig, EngineCoreRequest, FinishReason
from launch.shipped import shipped_model
from workers.layers.sampler import GrammarRows, _apply_grammar

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"point": {"$ref": "#/$defs/point"}, "ratio": {"type": "number",
                                                                                   "minimum": -1, "maximum": 1}},
     "required": ["point", "ratio"], "$defs": {"point": {"type": "object", "required": ["x", "y"], "properties": {
         "x": {"type": "integer", "minimum": -99, "maximum": 99},
         "y": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9}}}}},
    {"anyOf": [{"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"}, {"type": "boolean"}, {"type": "null"}]},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                                      "id": {"type": "string", "format": "uuid"}}, "required": ["when", "id"]},
]
SCHEMA_OUTPUTS = int(os.environ.get("PAGEDSERVE_SCHEMA_OUTPUTS", "30"))
REGEX = r"[a-z]{2,4}-\d{2}( [A-Z]{1,8})?"
CHOICES = ["yes", "no", 'a "quoted"\nchoice', "déjà vu"]
ARITHMETIC = 'root ::= expr\nexpr ::= term (("+" | "*") term)*\nterm ::= "0" | [1-9] [0-9]{0,2} | "(" expr ")"'


@pytest.fixture(scope="module")
def llm(llama_model):
    llm = LLM(llama_model, dtype="float32", max_model_len=512)
    yield llm
    llm.shutdown()


def _sample(llm: LLM, constraint: StructuredOutputsParams, count: int, max_tokens: int = 120, **params) -> list[str]:
    sampling = [SamplingParams(structured_outputs=constraint, max_tokens=max_tokens, temperature=1.0, seed=seed,
                               **params)
                for seed in range(count)]
    outputs = llm.generate(["Here it is:"] * count, sampling, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs), [o.outputs[0].text for o in outputs]
    return [o.outputs[0].text for o in outputs]


@pytest.mark.parametrize("model", ["random", "demo"])
def test_sampled_json_validates_against_its_schema(llm, model):
    """SCHEMA_OUTPUTS sampled outputs over the schemas in turn, on the random tiny model and the trained demo: every
    one finishes and validates (PAGEDSERVE_SCHEMA_OUTPUTS=200 is the acceptance run)."""
    demo = LLM(str(shipped_model("demo")), dtype="float32", max_model_len=512) if model == "demo" else None
    engine = demo or llm
    try:
        schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(SCHEMA_OUTPUTS)]
        params = [SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), max_tokens=300,
                                 temperature=1.0, seed=seed) for seed, schema in enumerate(schemas)]
        outputs = engine.generate(["Here it is:"] * len(params), params, use_tqdm=False)
        for schema, output in zip(schemas, outputs):
            assert output.outputs[0].finish_reason == "stop", output.outputs[0].text
            jsonschema.validate(json.loads(output.outputs[0].text), schema,
                                format_checker=jsonschema.FormatChecker())
        assert_all_blocks_free(engine)
    finally:
        if demo is not None:
            demo.shutdown()


def test_regex_choice_grammar_and_json_object(llm):
    assert all(re.fullmatch(REGEX, text) for text in _sample(llm, StructuredOutputsParams(regex=REGEX), 6))
    assert all(text in CHOICES for text in _sample(llm, StructuredOutputsParams(choice=CHOICES), 6))
    # Random weights nest expressions at will: 40 seeds closed theirs in 2-141 tokens.
    for text in _sample(llm, StructuredOutputsParams(grammar=ARITHMETIC), 6, max_tokens=480):
        tree = ast.parse(text, mode="eval")
        assert {type(node) for node in ast.walk(tree)} <= {ast.Expression, ast.BinOp, ast.Add, ast.Mult,
                                                          ast.Constant}, text
    # Any object may nest or run on: random weights need not close one within max_tokens; a closed one parses.
    outputs = llm.generate(["Here it is:"] * 8, [SamplingParams(structured_outputs=StructuredOutputsParams(
        json_object=True), max_tokens=60, temperature=1.0, seed=seed) for seed in range(8)], use_tqdm=False)
    finished = [o.outputs[0].text for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(text), dict) for text in finished)
    assert all(o.outputs[0].text.startswith("{") for o in outputs)


def test_constraints_hold_with_n_penalties_min_tokens_and_preemption(llama_model):
    llm = LLM(llama_model, dtype="float32", max_model_len=256, num_kv_blocks=24, block_size=16)
    schema = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 25, "maxItems": 25}
    params = SamplingParams(n=2, structured_outputs=StructuredOutputsParams(json=schema), max_tokens=200,
                            temperature=1.0, seed=1, repetition_penalty=1.3, min_tokens=2)
    try:
        outputs = llm.generate([f"{i} {i + 1} prompt" * 8 for i in range(6)], params, use_tqdm=False)
        for output in outputs:
            assert len(output.outputs) == 2
            for sample in output.outputs:
                jsonschema.validate(json.loads(sample.text), schema)
        assert llm.get_stats().num_preemptions > 0
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_schemas_go_to_the_backend_that_enforces_every_keyword():
    assert json_schema_backend(SCHEMAS[1]) == json_schema_backend(SCHEMAS[2]) == "xgrammar"
    assert json_schema_backend(SCHEMAS[0]) == "guidance"  # maxLength: xgrammar would let control characters in
    nested = {"type": "object", "properties": {"a": {"type": "array", "items": {"uniqueItems": True}}}}
    assert json_schema_backend(nested) == "guidance"
    assert json_schema_backend({"type": "string", "format": "idn-email"}) == "guidance"
    assert json_schema_backend({"properties": {"not": {"type": "string"}}}) == "xgrammar"  # a name, not a keyword
    assert json_schema_backend({"format": {"not": "a string"}}) == "guidance"  # which refuses it by name
    assert json_schema_backend({"type": "string", "format": "date", "pattern": "^2"}) == "guidance"


def test_date_formats_become_exact_patterns():
    """Both backends approximate a date (xgrammar: 31 November; llguidance: 29 February 2023); the pattern a
    date format becomes accepts exactly the dates Python does."""
    date = re.compile(EXACT_FORMATS["date"])
    for year in (1, 4, 96, 100, 400, 1700, 1900, 2000, 2023, 2024, 9999):
        for month, day in itertools.product(range(1, 13), range(1, 33)):
            text = f"{year:04d}-{month:02d}-{day:02d}"
            try:
                valid = datetime.date.fromisoformat(text) is not None
            except ValueError:
                valid = False
            assert bool(date.fullmatch(text)) == valid, text
    assert not date.fullmatch("0000-01-01")
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                               "t": {"type": "string", "format": "time", "pattern": "^1"}}}
    exact = json.loads(with_exact_formats(json.dumps(schema)))
    assert exact["properties"]["d"] == {"type": "string", "pattern": f"^{EXACT_FORMATS['date']}$"}
    assert exact["properties"]["t"] == schema["properties"]["t"]  # a pattern of its own: left to llguidance


@pytest.mark.parametrize("constraint, message", [
    (dict(regex="(a"), "structured_outputs.regex could not be compiled: Regex parsing error"),
    (dict(grammar="root ::= ("), "structured_outputs.grammar could not be compiled: EBNF parser error"),
    (dict(json={"type": "object", "properties": 5}), "structured_outputs.json could not be compiled"),
    (dict(json={"type": "array", "uniqueItems": True}), 'Unimplemented keys: ["uniqueItems"]'),
    (dict(json={"type": "string", "format": "no-such-format"}), "Unknown format: no-such-format"),
])
def test_a_bad_constraint_fails_its_request_alone_with_the_parsers_message(llm, constraint, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)), use_tqdm=False)
    [fine] = llm.generate("x", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(fine.outputs[0].token_ids) == 3
    assert_all_blocks_free(llm)


def test_exactly_one_constraint_and_valid_json_text():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{")
    assert StructuredOutputsParams(json='{"b": 1, "a": 2}').cache_key == StructuredOutputsParams(
        json={"a": 2, "b": 1}).cache_key


def _nested_any_of(depth: int) -> dict:
    """A schema xgrammar takes seconds to compile at depth 7 (and ~30 s at 8) for this vocabulary."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"anyOf": [{"type": "object", "properties": {"a": schema, "b": schema}},
                            {"type": "array", "items": schema}]}
    return schema


def test_a_slow_compile_times_out_and_an_abort_while_compiling_ends_the_request(llama_model):
    engine = EngineCore(EngineConfig(model=llama_model, dtype="float32", max_model_len=256, num_kv_blocks=64,
                                     structured_outputs_compile_timeout=0.3))
    slow = SamplingParams(structured_outputs=StructuredOutputsParams(json=_nested_any_of(7)), max_tokens=4)
    plain = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    engine.add_request(EngineCoreRequest(request_id="slow", prompt_token_ids=[5, 6, 7], sampling_params=slow))
    engine.add_request(EngineCoreRequest(request_id="also-slow", prompt_token_ids=[5, 6], sampling_params=slow))
    engine.add_request(EngineCoreRequest(request_id="plain", prompt_token_ids=[1, 2, 3], sampling_params=plain))
    # another constraint compiles beside the slow one, not after it
    fast = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]{4}"), max_tokens=8)
    engine.add_request(EngineCoreRequest(request_id="fast", prompt_token_ids=[1, 2], sampling_params=fast))
    assert [o.finish_reason for o in engine.abort_requests(["also-slow"])] == [FinishReason.ABORT]
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finish_reason is not None:
                assert output.request_id not in finals  # exactly one final output each
                finals[output.request_id] = output
    assert set(finals) == {"slow", "plain", "fast"} and finals["fast"].finish_reason == FinishReason.STOP
    assert finals["slow"].finish_reason == FinishReason.ERROR and finals["slow"].error_kind == "invalid"
    assert "took longer than 0.3 s to compile" in finals["slow"].error
    assert finals["plain"].finish_reason == FinishReason.LENGTH
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
    engine.shutdown()


def test_a_compiler_bug_fails_its_request_as_the_engines_fault_not_the_clients(llama_model, monkeypatch):
    def broken(self, params, *result):
        raise KeyError("injected")
    # Compiles run in worker processes, whose results the engine rebuilds (restore), or in the engine itself until
    # the first worker is up (compile): the bug is injected in both places the engine runs.
    monkeypatch.setattr("core.structured_output.backends.Backends.restore", broken)
    monkeypatch.setattr("core.structured_output.backends.Backends.compile", broken)
    engine = EngineCore(EngineConfig(model=llama_model, dtype="float32", max_model_len=256, num_kv_blocks=64))
    try:
        constrained = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+"), max_tokens=8)
        engine.add_request(EngineCoreRequest(request_id="r", prompt_token_ids=[5, 6, 7], sampling_params=constrained))
        finals = []
        while engine.has_unfinished_requests():
            finals += [o for o in engine.step() if o.finish_reason is not None]
        [final] = finals
        assert final.error_kind == "failed" and "KeyError" in final.error  # a 500, where a bad constraint is a 400
    finally:
        engine.shutdown()


class _BrokenGrammar:
    """A matcher whose backend fails: while filling the mask, or while accepting a token."""

    def __init__(self, fails_in: str) -> None:
        self.fails_in, self.is_terminated = fails_in, False

    def fill(self, bitmask, row: int) -> None:
        if self.fails_in == "fill":
            raise RuntimeError("injected fill failure")
        bitmask[row] = -1

    def accept(self, token_id: int) -> bool:
        if self.fails_in == "accept":
            raise RuntimeError("injected accept failure")
        return True


@pytest.mark.parametrize("fails_in", ["fill", "accept"])
def test_a_grammar_failing_mid_generation_ends_its_request_alone(llama_model, fails_in):
    engine = EngineCore(EngineConfig(model=llama_model, dtype="float32", max_model_len=256, num_kv_blocks=64))
    constrained = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+"), max_tokens=8)
    plain = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    engine.add_request(EngineCoreRequest(request_id="broken", prompt_token_ids=[5, 6, 7], sampling_params=constrained))
    engine.add_request(EngineCoreRequest(request_id="plain", prompt_token_ids=[1, 2, 3], sampling_params=plain))
    finals = {}
    while engine.has_unfinished_requests():
        for request in list(engine.scheduler.requests.values()):
            if request.grammar is not None and not isinstance(request.grammar, _BrokenGrammar):
                request.grammar = _BrokenGrammar(fails_in)
        finals |= {o.request_id: o for o in engine.step() if o.finish_reason is not None}
    assert finals["broken"].finish_reason == FinishReason.ERROR
    assert f"injected {fails_in} failure" in finals["broken"].error
    assert finals["plain"].finish_reason == FinishReason.LENGTH
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
    engine.shutdown()


def test_the_grammar_mask_keeps_exactly_the_allowed_tokens():
    vocab, generator = 70, torch.Generator().manual_seed(0)
    allowed = torch.rand(2, vocab, generator=generator) < 0.3
    words = torch.zeros(2, 3, dtype=torch.int64)
    for row, token in allowed.nonzero().tolist():
        words[row, token // 32] |= 1 << (token % 32)
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31 is the sign bit
    logits = torch.randn(3, vocab, generator=generator)
    expected = logits.clone()
    expected[[0, 2]] = expected[[0, 2]].masked_fill(~allowed, float("-inf"))
    _apply_grammar(logits, GrammarRows(rows=[0, 2], packed=packed))
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMAS[0],
                                                                "strict": True}}),
    ("structured_outputs", {"json": SCHEMAS[0]}),
    ("guided_json", SCHEMAS[0]),
])
def test_the_gateway_takes_each_way_of_asking_for_a_schema(client, llama_model, field, value):
    completion = client.chat.completions.create(
        model=llama_model, messages=[{"role": "user", "content": "Who?"}], max_tokens=100, seed=3,
        **({"response_format": value} if field == "response_format" else {"extra_body": {field: value}}))
    jsonschema.validate(json.loads(completion.choices[0].message.content), SCHEMAS[0])
    assert completion.choices[0].finish_reason == "stop"


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
TAGGED_CITY = {"type": "tag", "begin": "<r>", "content": {"type": "json_schema", "json_schema": CITY}, "end": "</r>"}


def test_structural_tags_offline_and_over_http(llm, server, llama_model):
    """xgrammar's structural tag (structured_outputs.structural_tag, or vLLM's response_format of that type, its
    `format` or the older `structures` and `triggers`): the output is the tag around JSON valid for its schema."""
    def check(text: str) -> None:
        found = re.fullmatch(r"<r>(.*)</r>", text, re.DOTALL)
        assert found, text
        jsonschema.validate(json.loads(found.group(1)), CITY)

    tag = json.dumps({"type": "structural_tag", "format": TAGGED_CITY})
    for text in _sample(llm, StructuredOutputsParams(structural_tag=tag), 4):
        check(text)
    url = server[1] + "/v1/completions"
    body = {"model": llama_model, "prompt": "A:", "max_tokens": 100, "seed": 0}
    response = httpx.post(url, headers=AUTH, timeout=60, json={
        **body, "response_format": {"type": "structural_tag", "format": TAGGED_CITY}})
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "stop", response.text
    check(response.json()["choices"][0]["text"])
    legacy = {"type": "structural_tag", "structures": [{"begin": "<r>", "schema": CITY, "end": "</r>"}],
              "triggers": ["<r>"]}
    response = httpx.post(url, headers=AUTH, timeout=60, json={**body, "response_format": legacy})
    text = response.json()["choices"][0]["text"]
    assert response.status_code == 200
    for found in re.finditer(r"<r>(.*?)</r>", text, re.DOTALL):  # free text outside the tags
        jsonschema.validate(json.loads(found.group(1)), CITY)
    for format_, message in [({"type": "nope"}, "structural_tag could not be compiled"), (None, "needs")]:
        response = httpx.post(url, headers=AUTH, timeout=60, json={
            **body, "response_format": {"type": "structural_tag", "format": format_}})
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def test_the_gateway_takes_choice_regex_json_object_and_refuses_bad_ones(server, llama_model):
    url = server[1] + "/v1/completions"
    # Random weights need not close an object within max_tokens: a closed one parses, an open one starts as one.
    for extra, check in [({"guided_choice": CHOICES}, lambda text, _: text in CHOICES),
                         ({"guided_regex": REGEX}, lambda text, _: re.fullmatch(REGEX, text)),
                         ({"response_format": {"type": "json_object"}},
                          lambda text, finish: isinstance(json.loads(text), dict) if finish == "stop"
                          else text.startswith("{"))]:
        response = httpx.post(url, headers=AUTH, timeout=60, json={"model": llama_model, "prompt": "A:",
                                                                   "max_tokens": 100, "seed": 0, **extra})
        choice = response.json()["choices"][0]
        assert response.status_code == 200 and check(choice["text"], choice["finish_reason"]), response.text
    for extra, param, message in [
        ({"guided_regex": "(a"}, None, "structured_outputs.regex could not be compiled"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "one output constraint at a time"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema is given"),
        ({"structured_outputs": {"json": "[1]"}}, "structured_outputs", "must be a JSON schema"),
    ]:
        response = httpx.post(url, headers=AUTH, timeout=60, json={"model": llama_model, "prompt": "A:", **extra})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert message in error["message"] and (param is None or error["param"] == param), error
    assert httpx.get(server[1] + "/health").status_code == 200


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def _calls(message) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_are_valid_and_stream_the_same(client, llama_model, tool_choice):
    tools = [WEATHER, TIME]
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    asked = dict(model=llama_model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                 tool_choice=tool_choice, max_tokens=120, temperature=0)
    completion = client.chat.completions.create(**asked)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = _calls(choice.message)
    assert calls and all(call.id.startswith("call_") for call in choice.message.tool_calls)
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == ["get_time"]
    chunks = list(client.chat.completions.create(**asked, stream=True))
    streamed: dict[int, dict] = {}
    for chunk in chunks:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = streamed.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(streamed.items())] == calls
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_messages_go_through_the_template_and_unserved_tool_choices_are_400s(server, llama_model):
    url, call = server[1] + "/v1/chat/completions", {"id": "call_1", "type": "function",
                                                    "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    conversation = [{"role": "user", "content": "Time?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    answer = httpx.post(url, headers=AUTH, timeout=60, json={
        "model": llama_model, "messages": conversation, "tools": [TIME], "tool_choice": "none", "max_tokens": 4})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["tool_calls"] == []
    for extra, message in [({"tools": [TIME]}, 'tool_choice "auto"'), ({"tools": [TIME], "tool_choice": "auto"},
                                                                       'tool_choice "auto"'),
                           ({"tool_choice": "required"}, "tool_choice needs tools"),
                           ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                            "'nope', which is not among the tools"),
                           ({"tools": [TIME], "tool_choice": "required", "guided_regex": "a"},
                            "one output constraint at a time")]:
        response = httpx.post(url, headers=AUTH, timeout=60, json={
            "model": llama_model, "messages": conversation[:1], **extra})
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
