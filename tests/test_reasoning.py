"""Reasoning parsers and the constraint gate: <think>...</think> becomes reasoning_content (whole and streamed alike),
an output constraint applies only after the section, and tool_choice "auto" reads hermes calls end to end."""
from __future__ import annotations

import json
import random

import httpx
import jsonschema
import pytest
from transformers import AutoTokenizer

from conftest import API_KEY, assert_all_blocks_free
from frontend import LLM, SamplingParams, StructuredOutputsParams
from frontend.api.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningSplitter,
    section_start,
    split_reasoning,
)
from frontend.tokenizer import apply_chat_template
from ipc import ReasoningSection
from launcher import start_launcher, stop_launcher

ANSWERS = [
    "<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4.",
    "no tags at all",
    "<think>unfinished thoughts, cut by max_tokens",
    "thinking without an opening tag</think>the answer",
    "<thi",
    "<think></think>{\"a\": 1}",
    "a</think>b</think>c",
]


@pytest.mark.parametrize("start", ["inside", "maybe", "closed"])
@pytest.mark.parametrize("answer", ANSWERS)
def test_streamed_split_equals_the_whole_split(start, answer):
    """However the text is cut into deltas, the streamed parts join into what the whole answer splits into."""
    reasoning, content = split_reasoning(start, answer)
    rng = random.Random(len(answer))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(answer)), min(len(answer) - 1, rng.randint(0, 6))))
        pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])]
        splitter = ReasoningSplitter(start)
        parts = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
        streamed_reasoning, streamed_content = ("".join(p[i] for p in parts) for i in (0, 1))
        assert streamed_reasoning == (reasoning or "") and streamed_content == (content or "")


def test_where_the_section_lies():
    r1, qwen3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
    assert split_reasoning("inside", ANSWERS[0]) == ("\nLet me see: 2 + 2.\n", "It is 4.")
    assert split_reasoning("inside", ANSWERS[2]) == ("unfinished thoughts, cut by max_tokens", None)
    assert split_reasoning("maybe", ANSWERS[1]) == (None, "no tags at all")  # a non-thinking Qwen3
    assert split_reasoning("inside", ANSWERS[3]) == ("thinking without an opening tag", "the answer")
    assert split_reasoning("closed", ANSWERS[0]) == (None, ANSWERS[0])
    assert section_start(r1, "<|im_start|>assistant\n") == "inside"
    assert section_start(qwen3, "<|im_start|>assistant\n") == "maybe"
    assert section_start(qwen3, "<|im_start|>assistant\n<think>\n") == "inside"
    assert section_start(r1, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == "closed"


def test_a_template_that_switches_thinking_off_leaves_no_section(llama_model):
    """chat_template_kwargs reach the template (Qwen3's enable_thinking); its closed <think></think> means none."""
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                "<think>\n\n</think>\n\n{% endif %}")
    tokenizer = AutoTokenizer.from_pretrained(llama_model)
    messages = [{"role": "user", "content": "hi"}]
    off = apply_chat_template(tokenizer, messages, "m", chat_template=template, template_kwargs={
        "enable_thinking": False})
    on = apply_chat_template(tokenizer, messages, "m", chat_template=template)
    qwen3 = REASONING_PARSERS["qwen3"]
    assert (section_start(qwen3, off), section_start(qwen3, on)) == ("closed", "maybe")
    with pytest.raises(ValueError, match="may not set add_generation_prompt, tools"):
        apply_chat_template(tokenizer, messages, "m", template_kwargs={"tools": [], "add_generation_prompt": 1})


@pytest.fixture(scope="module")
def llm(llama_model):
    llm = LLM(llama_model, dtype="float32", max_model_len=256)
    yield llm
    llm.shutdown()


def _generate(llm: LLM, section: ReasoningSection, logit_bias: dict[int, float], max_tokens: int = 24):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logit_bias=logit_bias,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"], reasoning=section))
    [output] = llm.generate(["Answer:"], params, use_tqdm=False)
    return output.outputs[0]


def test_the_constraint_starts_after_the_section(llm):
    tokenizer = llm.get_tokenizer()
    think, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    # </think> forced first: the section ends at once and the choice constrains the rest
    out = _generate(llm, ReasoningSection(end_token_ids=[end]), {end: 100})
    assert out.token_ids[0] == end and out.text.removeprefix("</think>") in ("yes", "no") and out.finish_reason == "stop"
    # inside the section nothing is constrained: <think> (no choice starts with it) fills the output
    out = _generate(llm, ReasoningSection(end_token_ids=[end]), {think: 100})
    assert set(out.token_ids) == {think} and out.finish_reason == "length"
    # an optional section the output opens: likewise unconstrained after its opening token
    out = _generate(llm, ReasoningSection(end_token_ids=[end], open_token_id=think), {think: 100})
    assert set(out.token_ids) == {think} and out.finish_reason == "length"
    # ... which may open it even where </think> is pushed: <think> is allowed first, </think> is not
    out = _generate(llm, ReasoningSection(end_token_ids=[end], open_token_id=think), {end: 100, think: 50})
    assert out.token_ids[:2] == [think, end] and out.text[len("<think></think>"):] in ("yes", "no")
    # ... and one it does not open: the constraint holds from the first token
    out = _generate(llm, ReasoningSection(end_token_ids=[end], open_token_id=think), {end: 100, think: -100})
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def server(llama_model):
    process, base_url = start_launcher(["--model", llama_model, "--dtype", "float32", "--max-model-len", "1024",
                                        "--api-key", API_KEY, "--enable-auto-tool-choice", "--tool-call-parser",
                                        "hermes", "--reasoning-parser", "deepseek_r1"])
    yield process, base_url
    stop_launcher(process)


TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}


def _streamed(chunks) -> tuple[str, str, list[tuple[str, str]], list[str]]:
    """(reasoning_content, content, tool calls, finish reasons) reassembled from a chat stream."""
    reasoning, content, calls, finish = "", "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish += [choice.finish_reason] if choice.finish_reason else []
    return reasoning, content, [tuple(entry) for _, entry in sorted(calls.items())], finish


def test_a_schema_applies_after_the_thinking_whole_and_streamed(client, llama_model, llm):
    end = llm.get_tokenizer().convert_tokens_to_ids("</think>")
    asked = dict(model=llama_model, messages=[{"role": "user", "content": "A digit?"}], max_tokens=60, temperature=0,
                 response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
                 logit_bias={str(end): 100})
    message = client.chat.completions.create(**asked).choices[0].message
    assert message.reasoning_content == ""
    jsonschema.validate(json.loads(message.content), SCHEMA)
    reasoning, content, _, finish = _streamed(client.chat.completions.create(**asked, stream=True))
    assert (reasoning, content, finish) == ("", message.content, ["stop"])
    # unconstrained thinking that never ends: all of it is reasoning, there is no content
    thinking = client.chat.completions.create(**{**asked, "logit_bias": {}, "max_tokens": 12, "response_format": None})
    assert thinking.choices[0].finish_reason == "length" and thinking.choices[0].message.content is None
    assert thinking.choices[0].message.reasoning_content


def test_auto_tool_calls_written_in_hermes_format_come_back_as_calls(client, llama_model, llm):
    """The model is made to write a hermes call (a regex constraint stands in for a model trained to); the parser
    reads it, whole and streamed. The template renders the tools into the prompt."""
    end = llm.get_tokenizer().convert_tokens_to_ids("</think>")
    call = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "CET"\}\}\n</tool_call>'
    asked = dict(model=llama_model, messages=[{"role": "user", "content": "Time in Berlin?"}], tools=[TIME],
                 max_tokens=80, temperature=0, logit_bias={str(end): 100},
                 extra_body={"structured_outputs": {"regex": call}})
    completion = client.chat.completions.create(**asked)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_time", {"zone": "CET"})]
    reasoning, content, streamed_calls, finish = _streamed(client.chat.completions.create(**asked, stream=True))
    assert [(name, json.loads(arguments)) for name, arguments in streamed_calls] == calls
    assert finish == ["tool_calls"] and not content
    without_tools = client.chat.completions.create(**{**asked, "tools": None, "extra_body": {}, "max_tokens": 1})
    assert completion.usage.prompt_tokens > without_tools.usage.prompt_tokens + 50  # the tools are in the prompt


def test_chat_template_kwargs_are_taken_but_not_in_place_of_the_fields(server, llama_model):
    url = server[1] + "/v1/chat/completions"
    body = {"model": llama_model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(url, headers=headers, json={**body, "chat_template_kwargs": {"enable_thinking": False}},
                      timeout=60).status_code == 200
    refused = httpx.post(url, headers=headers, json={**body, "chat_template_kwargs": {"messages": []}}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs", refused.text
