"""The generated conversations the demo is fine-tuned on: every answer is what a constrained request would accept
(an object valid against its schema, one call to a listed tool with valid arguments), in the template's format."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
from transformers import AutoTokenizer

from launch import demo_skills
from launch.make_tokenizer import CHAT_TEMPLATE
from launch.shipped import shipped_model


@pytest.mark.parametrize("seed", range(50))
def test_an_object_answer_is_valid_against_its_schema(seed):
    rng = random.Random(seed)
    schema = demo_skills.random_schema(rng)
    jsonschema.validate(demo_skills.values_for(schema, rng), schema)
    messages = demo_skills.json_turn(rng)
    assert messages[-1]["role"] == "assistant" and isinstance(json.loads(messages[-1]["content"]), dict)


def test_a_tool_turn_calls_a_listed_tool_with_valid_arguments_then_may_answer_its_result():
    rng, answered = random.Random(0), 0
    for _ in range(300):
        messages, tools = demo_skills.tool_turn(rng)
        schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
        call, *rest = [m for m in messages if m["role"] in ("assistant", "tool")]
        ((name, arguments),) = [(c["function"]["name"], c["function"]["arguments"]) for c in call["tool_calls"]]
        jsonschema.validate(arguments, schemas[name])
        if rest:
            assert [m["role"] for m in rest] == ["tool", "assistant"]
            answered += 1
    assert 0 < answered < 300


def test_documents_render_through_the_demo_template_with_the_calls_in_its_tool_call_tags():
    tokenizer = AutoTokenizer.from_pretrained(shipped_model("demo"))

    def render(messages: list[dict], tools: list[dict] | None) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=CHAT_TEMPLATE)

    documents = demo_skills.skill_documents(render, 40, seed=0)
    assert len(documents) == 40 and documents == demo_skills.skill_documents(render, 40, seed=0)
    assert all(d.startswith("<|im_start|>") and d.rstrip().endswith("<|im_end|>") for d in documents)
    assert sum("<tools>" in d for d in documents) == 20
    # a call begins right where the generation prompt ends, so the model learns to start one from there
    assert any("<|im_start|>assistant\n<tool_call>\n{\"name\": " in d for d in documents)
