"""The OpenAI-compatible gateway, through the launcher, with the official openai client and raw HTTP; and, for what
needs no engine (a missing chat template, a bug, a client that hangs up early), in process over a stub engine."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from conftest import API_KEY, AUTH, engine_slowed, long_context_llama, metric, serve_tiny_llama, wait_until
from frontend import LLM, RequestFailedError, SamplingParams
from frontend.api.push import PushHttpToolsProtocol
from frontend.api.sampling import ServerLimits
from frontend.api.server import build_app
from frontend.tokenizer import load_tokenizer
from ipc import EngineInfo
from launcher import descendants, engine_pid, start_launcher, stop_launcher

SURROGATE = "a\ud800b"  # a lone UTF-16 surrogate: valid JSON ("a\\ud800b"), not valid Unicode


def test_openai_client_end_to_end(client, llama_model):
    [model] = [m.id for m in client.models.list().data]
    assert model == llama_model
    plain = client.completions.create(model=model, prompt="Hello there", max_tokens=12, temperature=0)
    [expected] = LLM(llama_model, dtype="float32", in_process=True).generate(
        "Hello there", SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert plain.choices[0].text == expected.outputs[0].text
    assert plain.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert plain.usage.completion_tokens == len(expected.outputs[0].token_ids)
    streamed = list(client.completions.create(model=model, prompt="Hello there", max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain.choices[0].text
    assert streamed[-1].usage.completion_tokens == plain.usage.completion_tokens and not streamed[-1].choices


def test_chat_plain_streamed_and_n(client, llama_model):
    messages = [{"role": "user", "content": "Tell me a story"}]
    plain = client.chat.completions.create(model=llama_model, messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=llama_model, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert chunks[-1].usage.total_tokens == plain.usage.total_tokens
    two = client.chat.completions.create(model=llama_model, messages=messages, max_tokens=10, n=2, temperature=1.0,
                                         seed=1, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.choices[0].message.content != two.choices[1].message.content
    assert two.usage.completion_tokens == 20 and two.usage.prompt_tokens == plain.usage.prompt_tokens
    streamed_two = client.chat.completions.create(model=llama_model, messages=messages, max_tokens=10, n=2,
                                                  temperature=1.0, seed=1, stream=True,
                                                  extra_body={"ignore_eos": True})
    texts = ["", ""]
    for chunk in streamed_two:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [choice.message.content for choice in two.choices]


def test_stop_strings_and_seeds(client, llama_model):
    base = client.completions.create(model=llama_model, prompt="Once upon", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    stopped = client.completions.create(model=llama_model, prompt="Once upon", max_tokens=30, temperature=0,
                                        stop=[stop], extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    assert text.startswith(stopped.choices[0].text)
    penalized = client.completions.create(model=llama_model, prompt="Once upon", max_tokens=30, temperature=0,
                                          frequency_penalty=2.0, extra_body={"ignore_eos": True})
    assert penalized.choices[0].text != text  # penalties reach the sampler
    sampled = [client.completions.create(model=llama_model, prompt="Once upon", max_tokens=20, temperature=1.0,
                                         seed=seed).choices[0].text for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_cache_salt_keeps_tenants_apart(client, server, llama_model):
    prompt = " ".join(f"word{i}" for i in range(40))  # several full KV blocks
    request = dict(model=llama_model, prompt=prompt, max_tokens=1)
    client.completions.create(**request, extra_body={"cache_salt": "tenant-a"})
    hits = metric(server[1], "pagedserve:prefix_cache_hits_total")
    client.completions.create(**request, extra_body={"cache_salt": "tenant-b"})
    assert metric(server[1], "pagedserve:prefix_cache_hits_total") == hits  # another tenant: nothing shared
    client.completions.create(**request, extra_body={"cache_salt": "tenant-a"})
    assert metric(server[1], "pagedserve:prefix_cache_hits_total") >= hits + 16  # the same tenant: its blocks


def test_logprobs_logit_bias(client, llama_model):
    greedy = dict(model=llama_model, prompt="Once upon", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**greedy, logprobs=3)
    [expected] = LLM(llama_model, dtype="float32", in_process=True).generate(
        "Once upon", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3), use_tqdm=False)
    logprobs = plain.choices[0].logprobs
    completion = expected.outputs[0]
    assert logprobs.token_logprobs == pytest.approx([e[t].logprob for t, e in zip(completion.token_ids,
                                                                                 completion.logprobs)], abs=1e-5)
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) <= 3 and list(top.values()) == sorted(top.values(), reverse=True)
        assert top[token] == pytest.approx(value) == pytest.approx(max(top.values()))  # greedy: the top token
    assert logprobs.tokens == [e[t].decoded_token for t, e in zip(completion.token_ids, completion.logprobs)]
    lengths = [len(token) for token in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    streamed = list(client.completions.create(**greedy, logprobs=3, stream=True))
    assert [v for c in streamed for v in c.choices[0].logprobs.token_logprobs] == pytest.approx(
        logprobs.token_logprobs, abs=1e-5)
    chat = client.chat.completions.create(model=llama_model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    for item in chat.choices[0].logprobs.content:
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob) and bytes(item.bytes).decode() == item.token
    first_token = completion.token_ids[0]
    biased = client.completions.create(**greedy, logit_bias={str(first_token): -100})
    assert biased.choices[0].text != plain.choices[0].text


def test_prompt_logprobs_and_token_ids_over_http(client, server, llama_model):
    """vLLM's prompt_logprobs (whole answers: a 400 with stream) and return_token_ids (the prompt's ids, each
    choice's, streamed in deltas) on completions and chat; /load and /server_info."""
    [expected] = LLM(llama_model, dtype="float32", in_process=True).generate(
        "Once upon a time", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=2),
        use_tqdm=False)
    asked = {"prompt_logprobs": 2, "return_token_ids": True, "ignore_eos": True}
    plain = client.completions.create(model=llama_model, prompt="Once upon a time", max_tokens=6, temperature=0,
                                      extra_body=asked).choices[0].model_dump()
    assert plain["prompt_token_ids"] == expected.prompt_token_ids
    assert plain["token_ids"] == expected.outputs[0].token_ids
    assert plain["prompt_logprobs"][0] is None and len(plain["prompt_logprobs"]) == len(expected.prompt_token_ids)
    for got, reference in zip(plain["prompt_logprobs"][1:], expected.prompt_logprobs[1:], strict=True):
        assert {int(token) for token in got} == set(reference)
        for token, entry in got.items():
            assert entry["logprob"] == pytest.approx(reference[int(token)].logprob, abs=1e-5)
            assert entry["rank"] == reference[int(token)].rank
    streamed = [c.model_dump() for c in client.completions.create(
        model=llama_model, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True})]
    assert streamed[0]["choices"][0]["prompt_token_ids"] == expected.prompt_token_ids
    assert [t for c in streamed for t in c["choices"][0]["token_ids"]] == expected.outputs[0].token_ids
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=llama_model, messages=messages, max_tokens=5, temperature=0,
                                          extra_body=asked).model_dump()
    assert len(chat["prompt_token_ids"]) == len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"] == 5
    chunks = [c.model_dump() for c in client.chat.completions.create(
        model=llama_model, messages=messages, max_tokens=5, temperature=0, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True})]
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == chat["choices"][0]["token_ids"]
    refused = httpx.post(f"{server[1]}/v1/completions", headers=AUTH, json={
        "model": llama_model, "prompt": "hi", "stream": True, "prompt_logprobs": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    assert httpx.get(f"{server[1]}/load", headers=AUTH).json() == {"server_load": 0}
    info = httpx.get(f"{server[1]}/server_info", headers=AUTH).json()
    assert info["engine"]["model"] == llama_model and info["engine"]["max_model_len"] == 1024


def test_beam_search_over_http_equals_the_offline_one(client, server, llama_model):
    """use_beam_search with n beams and length_penalty, on completions and on chat (its templated prompt): the offline
    LLM.beam_search's beams (tested against HF transformers in test_beam_search.py), best first; what it does not
    return or honour is a 400 naming the field, on both routes."""
    from frontend import BeamSearchParams

    messages = [{"role": "user", "content": "Tell me a story"}]
    templated = httpx.post(f"{server[1]}/tokenize", headers=AUTH, json={"model": llama_model, "messages": messages})
    llm = LLM(llama_model, dtype="float32", in_process=True)
    try:
        params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5)
        expected, expected_chat = llm.beam_search(
            ["Once upon a time", {"prompt_token_ids": templated.json()["tokens"]}], params)
    finally:
        llm.shutdown()
    reply = client.completions.create(model=llama_model, prompt="Once upon a time", max_tokens=6, n=3,
                                      extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.text for c in reply.choices] == [s.text for s in expected.sequences]
    assert [c.finish_reason for c in reply.choices] == [s.finish_reason for s in expected.sequences]
    assert reply.usage.completion_tokens == sum(len(s.tokens) - reply.usage.prompt_tokens for s in expected.sequences)
    chat = client.chat.completions.create(model=llama_model, messages=messages, max_completion_tokens=6, n=3,
                                          extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert len(chat.choices) == 3 and [(c.index, c.message.content, c.finish_reason) for c in chat.choices] == [
        (i, s.text, s.finish_reason) for i, s in enumerate(expected_chat.sequences)]
    assert chat.usage.prompt_tokens == templated.json()["count"]
    assert chat.usage.completion_tokens == sum(len(s.tokens) - chat.usage.prompt_tokens
                                               for s in expected_chat.sequences)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for path, body, field, value in (
            ("completions", {"prompt": "hi"}, "stream", True), ("completions", {"prompt": "hi"}, "logprobs", 1),
            ("completions", {"prompt": "hi"}, "echo", True),
            ("completions", {"prompt": "hi"}, "response_format", {"type": "json_object"}),
            ("chat/completions", {"messages": messages}, "stream", True),
            ("chat/completions", {"messages": messages}, "logprobs", True),
            ("chat/completions", {"messages": messages, "tool_choice": "required"}, "tools", [tool]),
            ("chat/completions", {"messages": messages}, "guided_regex", "a+")):
        refused = httpx.post(f"{server[1]}/v1/{path}", headers=AUTH, json={
            "model": llama_model, **body, "use_beam_search": True, field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": 1100}, 400, "max_tokens"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "top_p": 2.0}, 400, "top_p"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "n": 5}, 400, "n"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"model": "M", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "M", "prompt": [1, 10**7]}, 400, None),
    ("/v1/completions", {"model": "M"}, 400, "prompt"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "logit_bias": {"99999": 1}}, 400, None),
    ("/v1/completions", {"model": "M", "prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "cache_salt": ""}, 400, None),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "M", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
     400, "chat_template"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 3},
     400, "presence_penalty"),
    # The fuzzing run's repros: each used to kill the engine (top_k 2**63) or pass unchecked.
    ("/v1/completions", {"model": "M", "prompt": "Hello", "max_tokens": 4, "top_k": 2**63}, 400, "top_k"),
    ("/v1/completions", {"model": "M", "prompt": "Hello", "top_k": 2**64 + 5}, 400, "top_k"),
    ("/v1/completions", {"model": "M", "prompt": "Hello", "temperature": float("inf")}, 400, "temperature"),
    ("/v1/completions", {"model": "M", "prompt": "Hello", "temperature": 1e308}, 400, "temperature"),
    ("/v1/completions", {"model": "M", "prompt": "Hello", "repetition_penalty": float("inf")}, 400,
     "repetition_penalty"),
    ("/v1/completions", {"model": "M", "prompt": "Hello", "seed": 2**64}, 400, "seed"),
    # Positive but so small that dividing logits by it overflowed them all: once a 500.
    ("/v1/completions", {"model": "M", "prompt": "Hello", "repetition_penalty": 1e-320}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": "M", "prompt": "Hello", "repetition_penalty": 1e-300}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": "M", "prompt": "Hello", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": SURROGATE, "prompt": "hi"}, 404, "model"),  # the error echoes it
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "prompt"),
    # checked before any prompt is tokenized: the bad prompts never get the chance to fail
    ("/v1/completions", {"model": "M", "prompt": [SURROGATE] * 300, "n": 4}, 400, "n"),
])
def test_bad_requests_get_openai_errors(server, llama_model, path, body, status, param):
    body = {**body, "model": llama_model} if body.get("model") == "M" else body
    # json.dumps writes a lone surrogate as the escape "\ud800"; httpx's json= would fail to encode it
    response = httpx.post(server[1] + path, content=json.dumps(body),
                          headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:  # the field, or a path into it (logit_bias.5)
        assert error["param"] == param or error["param"].startswith(f"{param}."), error
    if status == 400 and param == "max_tokens" and body.get("max_tokens") == 1100:
        assert "1024 tokens" in error["message"] and "1100 max_tokens" in error["message"]  # both numbers
    if param == "n" and body.get("n") == 4:
        assert "1200 choices" in error["message"] and "--max-choices-per-request" in error["message"], error
    health = httpx.get(server[1] + "/health")
    assert health.status_code == 200  # and the engine serves on


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", SURROGATE]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": [SURROGATE]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "bad_words": [SURROGATE]}, "bad_words"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": SURROGATE}, "cache_salt"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {SURROGATE: 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
     "messages.0.content"),
    ("/tokenize", {"prompt": SURROGATE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "system", "content": "hi"}, {"role": "user", "content": SURROGATE}]},
     "messages.1.content"),
])
def test_lone_surrogates_get_a_400_naming_the_field(server, llama_model, path, body, field):
    response = httpx.post(server[1] + path, content=json.dumps({"model": llama_model, **body}),
                          headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith(field), response.json()


def test_tokenize_takes_content_parts_as_chat_does(server, llama_model):
    def tokens(content) -> list[int]:
        body = {"messages": [{"role": "user", "content": content}]}
        response = httpx.post(f"{server[1]}/tokenize", json=body, headers=AUTH)
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    assert tokens([{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]) == tokens("Hello\nworld")
    chat = httpx.post(f"{server[1]}/v1/chat/completions", headers=AUTH, json={
        "model": llama_model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hello\nworld"}]})
    assert chat.json()["usage"]["prompt_tokens"] == len(tokens("Hello\nworld"))


def test_malformed_json_and_oversized_requests(server):
    response = httpx.post(f"{server[1]}/v1/completions", content=b"{not json", headers=AUTH)
    assert response.status_code == 400 and "error" in response.json()
    huge = httpx.post(f"{server[1]}/v1/completions", content=b"x" * (11 * 2**20), headers=AUTH)
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "invalid_request_error"
    chunked = httpx.post(f"{server[1]}/v1/completions", content=iter([b"x" * 2**20] * 11),  # no Content-Length
                         headers={**AUTH, "Content-Type": "application/json"})
    assert chunked.status_code == 413 and "10485760 bytes" in chunked.json()["error"]["message"]
    big_header = httpx.get(f"{server[1]}/v1/models", headers={**AUTH, "X-Padding": "x" * 64 * 2**10})
    assert big_header.status_code == 431 and big_header.json()["error"]["message"]


def test_a_disconnected_plain_request_is_aborted(server, llama_model):
    aborted = metric(server[1], "pagedserve:num_aborted_requests_total")
    # The engine slowed while the client hangs up: on a fast machine the request's 4000 tokens (n = 4, 20 logprobs a
    # token) took a quarter of a second and ended between two polls. All four must be aborted.
    request = {"model": llama_model, "prompt": "go on", "max_tokens": 1000, "ignore_eos": True, "n": 4, "logprobs": 20}
    body = json.dumps(request).encode()
    host, port = server[1].removeprefix("http://").split(":")
    with engine_slowed(server, request), socket.create_connection((host, int(port))) as conn:  # hangs up once it runs
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_until(lambda: metric(server[1], "pagedserve:num_requests_running") >= 1, timeout=30)
        conn.close()
        assert wait_until(lambda: metric(server[1], "pagedserve:num_aborted_requests_total") == aborted + 4,
                          timeout=30)
    assert metric(server[1], "pagedserve:num_requests_running") == 0
    assert metric(server[1], "pagedserve:kv_cache_usage_perc") == 0.0


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                          ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                                          ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/version"),
                                          ("GET", "/openapi.json")])
def test_every_route_but_health_needs_the_key(server, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.request(method, server[1] + path, json={}, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server[1]}/health").status_code == 200


def test_the_openapi_contract_is_served_with_the_key(server):
    schema = httpx.get(f"{server[1]}/openapi.json", headers=AUTH).json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= set(schema["paths"])
    assert "CompletionRequest" in schema["components"]["schemas"]
    assert httpx.get(f"{server[1]}/docs", headers=AUTH).status_code == 404


def test_tokenize_detokenize_version(server):
    tokens = httpx.post(f"{server[1]}/tokenize", json={"prompt": "Hello world"}, headers=AUTH).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 1024
    text = httpx.post(f"{server[1]}/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH).json()
    assert text["prompt"].endswith("Hello world")
    bad = httpx.post(f"{server[1]}/detokenize", json={"tokens": [10**8]}, headers=AUTH)
    assert bad.status_code == 400


def test_two_gateway_processes_serve(server):
    def one_pid() -> int:
        with httpx.Client() as fresh:  # a new connection each time, so the kernel may pick either process
            return fresh.get(f"{server[1]}/version", headers=AUTH).json()["gateway_pid"]

    gateway_pids = {pid for pid, command in descendants(server[0].pid) if "frontend.api.server" in command}
    assert len(gateway_pids) == 2
    assert wait_until(lambda: {one_pid() for _ in range(20)} == gateway_pids, timeout=30)


def test_a_disconnected_stream_is_aborted_and_its_blocks_freed(server, llama_model):
    aborted = metric(server[1], "pagedserve:num_aborted_requests_total")
    body = {"model": llama_model, "prompt": "go on", "max_tokens": 1000, "stream": True, "ignore_eos": True,
            "logprobs": 20}
    with engine_slowed(server, body):  # unslowed, a fast machine finished the 1000 tokens before the hang-up reached it
        with httpx.stream("POST", f"{server[1]}/v1/completions", json=body, headers=AUTH) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
        assert wait_until(lambda: metric(server[1], "pagedserve:num_aborted_requests_total") == aborted + 1,
                          timeout=30)
    assert metric(server[1], "pagedserve:num_requests_running") == 0
    assert metric(server[1], "pagedserve:kv_cache_usage_perc") == 0.0
    metrics = httpx.get(f"{server[1]}/metrics", headers=AUTH).text
    for name in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_sum", "prompt_tokens_total", "generation_tokens_total",
                 "num_requests_waiting", "prefix_cache_hits"):
        assert f"pagedserve:{name}" in metrics, name


def test_sigterm_stops_everything(llama_model):
    process, _ = serve_tiny_llama(llama_model)  # its own: the session's server serves on
    children = [pid for pid, _ in descendants(process.pid)]
    assert len(children) >= 3  # the engine core and two gateways
    assert stop_launcher(process) == 0
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in children), timeout=10)


def test_back_pressure_and_engine_death():
    # The running request must outlive the scenario, so the queued one never gets its first output.
    model = long_context_llama()
    process, base_url = start_launcher(["--model", model, "--dtype", "float32", "--max-num-seqs", "1",
                                        "--max-waiting-requests", "1", "--kv-cache-memory", "40MiB"])
    try:
        body = {"model": model, "prompt": "slow", "max_tokens": 60_000, "ignore_eos": True, "stream": True}

        async def scenario():
            async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
                running = await _open_stream(http, body)  # runs
                waiting = asyncio.create_task(http.post("/v1/completions", json=body))  # waits in the queue
                # Polled, not slept on: the request waits as soon as the engine has read it.
                deadline = time.monotonic() + 10
                while not re.search(r"^pagedserve:num_requests_waiting\{.*\} 1\.0$",
                                    (await http.get("/metrics")).text, re.MULTILINE):
                    assert time.monotonic() < deadline, "the second request never waited"
                    await asyncio.sleep(0.01)
                refused = await http.post("/v1/completions", json=body)
                os.kill(engine_pid(process.pid), signal.SIGKILL)
                killed_at = time.monotonic()
                events = [line async for line in running.aiter_lines() if line.startswith("data: ")]
                while (await http.get("/health")).status_code != 503:
                    await asyncio.sleep(0.05)
                unhealthy_after = time.monotonic() - killed_at
                waiting_response = await waiting
                later = await http.post("/v1/completions", json={**body, "stream": False})
                metrics = await http.get("/metrics")
                # Routes the gateway answers alone follow the engine too; no 503 names the engine's address.
                alone = [await http.get("/v1/models"), await http.post("/tokenize", json={"prompt": "hi"}),
                         await http.post("/detokenize", json={"tokens": [1, 2]})]
                assert all(r.status_code == 503 and "://" not in r.text for r in [*alone, later, metrics]), alone
                return refused, events, unhealthy_after, waiting_response, later, metrics

        refused, events, unhealthy_after, waiting_response, later, metrics = asyncio.run(scenario())
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "overloaded"
        assert events[-1] == "data: [DONE]" and "error" in json.loads(events[-2].removeprefix("data: "))
        assert unhealthy_after < 2.0
        # A stream's headers go out with its first output: the queued request never had one, so it is a plain 503.
        assert waiting_response.status_code == 503 and waiting_response.json()["error"]["code"] == "engine_dead"
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_dead"
        assert metrics.status_code == 503 and metrics.json()["error"]["code"] == "engine_dead"
    finally:
        stop_launcher(process)


async def _open_stream(http: httpx.AsyncClient, body: dict) -> httpx.Response:
    response = await http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
    assert response.status_code == 200
    return response


class _StubEngine:
    """What the gateway uses of AsyncLLM, over no engine: a real tokenizer, requests that never produce an output
    (each one counted until it is released, as an abort does) or, with the prompt "fail", fail in the engine, and
    stats that fail as a bug would."""

    def __init__(self, model: str) -> None:
        self.tokenizer = load_tokenizer(model)
        self.info = EngineInfo(model=model, max_model_len=1024, vocab_size=len(self.tokenizer), num_kv_blocks=64,
                               block_size=16, scheduling_policy="fcfs")
        self.added = 0
        self.running: set[str] = set()

    def add_request(self, request_id: str, prompt, params, on_output, priority: int = 0, lora_request=None) -> str:
        if prompt.get("prompt") == "bug":
            raise OverflowError("an injected bug")
        self.added += 1
        self.running.add(request_id)
        if prompt.get("prompt") == "fail":
            error = RequestFailedError(f"the engine failed on request {request_id}: injected")
            asyncio.get_running_loop().call_soon(on_output, error)
        return request_id  # the request group stands for itself here

    def release(self, group: str) -> None:
        self.running.discard(group)

    async def get_stats(self):
        raise RuntimeError("a bug")

    async def check_health(self, max_stall_s: float) -> None:
        return None  # alive

    check_serving = check_health


@pytest.fixture(scope="module")
def stub(llama_model):
    """(stub engine, base URL): the gateway's app over a _StubEngine, served in this process by uvicorn."""
    engine = _StubEngine(llama_model)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    # log_config=None: uvicorn's records reach the root logger, where caplog sees them
    config = uvicorn.Config(build_app(engine, "stub", ServerLimits(max_model_len=1024)), http=PushHttpToolsProtocol,
                            lifespan="off", log_config=None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, timeout=10)
    yield engine, f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


def test_a_model_without_a_chat_template_gets_a_400(stub, monkeypatch):
    engine, base_url = stub
    monkeypatch.setattr(engine.tokenizer, "chat_template", None)
    messages = [{"role": "user", "content": "hi"}]
    for path, body in (("/tokenize", {"messages": messages}), ("/v1/chat/completions", {"model": "stub",
                                                                                       "messages": messages})):
        response = httpx.post(base_url + path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "no chat template" in error["message"] and error["param"] == "messages"


def test_a_bug_in_a_route_is_a_json_500_and_its_traceback_logged(stub, caplog):
    response = httpx.get(f"{stub[1]}/metrics")
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    assert wait_until(lambda: any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records), timeout=5)


def test_a_bug_on_a_kept_alive_connection_is_a_json_500_and_the_connection_serves_on(stub, caplog):
    with httpx.Client(base_url=stub[1]) as http:
        for _ in range(3):
            response = http.post("/v1/completions", json={"model": "stub", "prompt": "bug"})
            assert response.status_code == 500 and "OverflowError" in response.json()["error"]["message"]
    assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records)


def test_a_request_the_engine_failed_on_is_a_json_500_without_a_gateway_traceback(stub, caplog):
    response = httpx.post(f"{stub[1]}/v1/completions", json={"model": "stub", "prompt": "fail"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "request_failed" and "injected" in error["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("stream", [False, True])
def test_clients_gone_before_the_first_output_are_aborted_and_logged_at_debug(stub, caplog, stream):
    engine, base_url = stub
    caplog.set_level(logging.DEBUG, logger="pagedserve.api")
    body = json.dumps({"model": "stub", "prompt": "hello", "stream": stream}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    host, port = base_url.removeprefix("http://").split(":")
    for _ in range(10):
        added = engine.added
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(request)
            assert wait_until(lambda: engine.added == added + 1, timeout=5)
    assert wait_until(lambda: not engine.running, timeout=5)  # every request was aborted
    assert wait_until(lambda: sum("went away" in r.getMessage() for r in caplog.records) == 10, timeout=5)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
