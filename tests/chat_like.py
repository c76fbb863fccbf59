"""Helpers of the tests of the chat-like APIs (/v1/responses, /v1/messages) on the demo server: their named SSE
events, and the length of a conversation through the demo model's chat template."""
from __future__ import annotations

import functools
import json

import httpx
from transformers import AutoTokenizer

from launch.shipped import shipped_model


def named_events(url: str, headers: dict, body: dict) -> list[dict]:
    """The events of a streamed answer, each checked against its event: line."""
    events = []
    with httpx.stream("POST", url, headers=headers, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert event["type"] == name, (name, event)
                events.append(event)
    return events


@functools.cache
def _demo_tokenizer():
    return AutoTokenizer.from_pretrained(shipped_model())


def templated_length(messages: list[dict], tools: list[dict] | None = None) -> int:
    """The token count of a chat conversation (and its chat-form tools) through the demo model's template."""
    tokenizer = _demo_tokenizer()
    text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False).input_ids)
