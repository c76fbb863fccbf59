"""The generated conversations the demo is fine-tuned on: every answer is what a constrained request would accept
(an object valid against its schema, a call to a listed tool with valid arguments), in the template's format."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
from transformers import AutoTokenizer

from launch import demo_skills
from launch.shipped import shipped_model


@pytest.mark.parametrize("seed", range(50))
def test_an_object_answer_is_valid_against_its_schema(seed):
    rng = random.Random(seed)
    schema = demo_skills.random_schema(rng)
    jsonschema.validate(demo_skills.values_for(schema, rng), schema)
    messages = demo_skills.json_turn(rng)
    assert messages[-1]["role"] == "assistant" and isinstance(json.loads(messages[-1]["content"]), dict)


def test_a_tool_turn_calls_a_listed_tool_with_valid_arguments_in_one_of_the_three_forms():
    rng, forms = random.Random(0), set()
    for _ in range(300):
        messages, tools = demo_skills.tool_turn(rng)
        schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
        answer = next(m for m in messages if m["role"] == "assistant")
        if answer.get("tool_calls"):
            forms.add("template")
            (call,) = answer["tool_calls"]
            name, arguments = call["function"]["name"], call["function"]["arguments"]
        elif answer["content"].startswith("["):
            forms.add("required")
            ((name, arguments),) = [(c["name"], c["parameters"]) for c in json.loads(answer["content"])]
        else:
            forms.add("named")
            name, arguments = None, json.loads(answer["content"])
            assert any(_valid(arguments, schema) for schema in schemas.values())
            continue
        jsonschema.validate(arguments, schemas[name])
    assert forms == {"template", "required", "named"}


def _valid(instance: dict, schema: dict) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_documents_render_through_the_demo_template_with_the_calls_in_its_tool_call_tags():
    tokenizer = AutoTokenizer.from_pretrained(shipped_model("demo"))
    documents = demo_skills.skill_documents(
        lambda messages, tools: tokenizer.apply_chat_template(messages, tools=tools, tokenize=False), 40, seed=0)
    assert len(documents) == 40 and documents == demo_skills.skill_documents(
        lambda messages, tools: tokenizer.apply_chat_template(messages, tools=tools, tokenize=False), 40, seed=0)
    assert all(d.startswith("<|im_start|>") and d.rstrip().endswith("<|im_end|>") for d in documents)
    assert sum("<tools>" in d for d in documents) == 20
    assert any("<tool_call>\n{\"name\": " in d for d in documents)
