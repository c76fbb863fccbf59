"""vLLM's surface on the gateway (build_app over the tiny llama's engine, served in this process): /v1/models, an
optional model, fields refused by name, --chat-template, CORS, --root-path, TLS, request logs, generation defaults."""
from __future__ import annotations

import json
import logging
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import jinja2
import pytest
import uvicorn

from conftest import API_KEY, AUTH, wait_until
from frontend.api.cli_args import CorsOptions, build_parser
from frontend.api.request_log import RequestLogger
from frontend.api.sampling import ServerLimits
from frontend.api.server import build_app, uvicorn_config
from frontend.async_llm import AsyncLLM
from frontend.tokenizer import load_chat_template
from launcher import REPO, free_port

TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}|{{ m['content'] }}>>{% endfor %}"
            "{% if add_generation_prompt %}=>{% endif %}")
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def serve(engine_address, llama_model):
    """serve(flags=[...], **build_app options) -> (base URL, engine): a gateway app of its own, over its own client of
    the module's engine, served by uvicorn in a thread of this process with the gateway's flags."""
    running = []

    def start(flags: tuple[str, ...] = (), **options) -> tuple[str, AsyncLLM]:
        engine = AsyncLLM(llama_model, engine_address=engine_address)
        app = build_app(engine, "tiny", ServerLimits(max_model_len=engine.info.max_model_len), **options)
        config = uvicorn_config(app, build_parser().parse_args(["--engine-address", "unused", *flags]))
        config.lifespan, config.log_config = "off", None
        server = uvicorn.Server(config)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        assert wait_until(lambda: server.started, timeout=10)
        running.append((server, thread, engine))
        scheme = "https" if "--ssl-certfile" in flags else "http"
        return f"{scheme}://127.0.0.1:{sock.getsockname()[1]}", engine

    yield start
    for server, thread, engine in running:
        server.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()


@pytest.fixture(scope="module")
def plain(serve) -> str:
    return serve()[0]


def test_models_lists_root_parent_and_max_model_len(serve, plain, llama_model):
    [model] = httpx.get(f"{plain}/v1/models").json()["data"]
    assert model["id"] == "tiny" and model["root"] == llama_model and model["parent"] is None
    assert model["max_model_len"] == 1024  # the tiny llama's max_position_embeddings
    [named] = httpx.get(f"{serve(model_root='pagedserve-demo')[0]}/v1/models").json()["data"]
    assert named["root"] == "pagedserve-demo"


def test_a_request_without_model_gets_the_served_one(plain):
    response = httpx.post(f"{plain}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "tiny"
    schema = httpx.get(f"{plain}/openapi.json").json()["components"]["schemas"]
    assert all("model" not in schema[name].get("required", []) for name in ("CompletionRequest",
                                                                              "ChatCompletionRequest"))
    assert httpx.post(f"{plain}/v1/completions", json={"model": "other", "prompt": "Hello"}).status_code == 404


COMPLETION = {"prompt": "Hello", "max_tokens": 2}
CHAT = {"messages": HELLO, "max_tokens": 2}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**COMPLETION, "suffix": " world"}, "suffix"),
    ("/v1/completions", {**COMPLETION, "best_of": 3}, "best_of"),
    ("/v1/completions", {**COMPLETION, "n": 2, "best_of": 1}, "best_of"),
    ("/v1/completions", {**COMPLETION, "add_special_tokens": False}, "add_special_tokens"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {**CHAT, "logits_processors": ["my.module:Processor"]}, "logits_processors"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/tokenize", {"messages": HELLO, "add_generation_prompt": False}, "add_generation_prompt"),
])
def test_a_field_that_would_change_the_output_is_refused_by_name(plain, path, body, param):
    response = httpx.post(plain + path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: not supported"), error


def test_harmless_fields_pass_and_unknown_ones_are_logged_once(plain, caplog):
    caplog.set_level(logging.DEBUG, logger="pagedserve.api")
    harmless = {"user": "u1", "metadata": {"k": "v"}, "store": False, "parallel_tool_calls": True, "tools": [],
                "tool_choice": "none", "response_format": {"type": "text"}, "x_never_seen_field": 1}
    for _ in range(2):
        response = httpx.post(f"{plain}/v1/chat/completions", json={**CHAT, **harmless}, timeout=60)
        assert response.status_code == 200, response.text
    completion = httpx.post(f"{plain}/v1/completions", json={**COMPLETION, "best_of": 1, "echo": False}, timeout=60)
    assert completion.status_code == 200, completion.text
    logged = [r.getMessage() for r in caplog.records if "unknown field" in r.getMessage()]
    assert sum("'x_never_seen_field'" in message for message in logged) == 1, logged


def test_load_chat_template_reads_a_file_or_takes_the_text(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template("{{ 'a' }}\\n{{ 'b' }}") == "{{ 'a' }}\n{{ 'b' }}"  # as typed in a shell
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not valid Jinja"):
        load_chat_template("{% for m in messages %}")


def test_chat_template_flag_replaces_the_tokenizers(serve):
    base_url, engine = serve(chat_template=TEMPLATE)
    expected_text = jinja2.Template(TEMPLATE).render(messages=HELLO, add_generation_prompt=True)
    expected = engine.tokenizer.encode(expected_text, add_special_tokens=False)
    tokens = httpx.post(f"{base_url}/tokenize", json={"messages": HELLO}).json()["tokens"]
    assert tokens == expected
    chat = httpx.post(f"{base_url}/v1/chat/completions", json=CHAT, timeout=60)
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(expected)


def test_a_model_without_a_template_names_the_flag(serve):
    base_url, engine = serve()
    engine.tokenizer.chat_template = None  # this gateway's own tokenizer
    for path, body in (("/v1/chat/completions", CHAT), ("/tokenize", {"messages": HELLO})):
        response = httpx.post(base_url + path, json=body)
        assert response.status_code == 400 and "--chat-template" in response.json()["error"]["message"]


def test_cors_only_when_origins_are_allowed(serve, plain):
    origin = "http://app.example"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    base_url, _ = serve(api_key=API_KEY, cors=CorsOptions([origin]))
    answer = httpx.options(f"{base_url}/v1/completions", headers=preflight)  # a browser sends no key here
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == origin
    models = httpx.get(f"{base_url}/v1/models", headers={**AUTH, "Origin": origin})
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == origin
    assert httpx.get(f"{base_url}/v1/models", headers={"Origin": origin}).status_code == 401  # the key still counts
    assert httpx.options(f"{base_url}/v1/models", headers={**preflight, "Origin": "http://evil.example"}
                         ).status_code == 400
    assert "access-control-allow-origin" not in httpx.get(f"{plain}/v1/models", headers={"Origin": origin}).headers


def test_tls_and_root_path(serve, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    flags = ("--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/api")
    base_url, _ = serve(flags, api_key=API_KEY)
    with httpx.Client(verify=ssl.create_default_context(cafile=str(cert))) as client:
        assert client.get(f"{base_url}/health").status_code == 200  # still without the key behind a root path
        models = client.get(f"{base_url}/v1/models", headers=AUTH)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
        assert client.get(f"{base_url}/v1/models").status_code == 401
        assert client.get(f"{base_url}/openapi.json", headers=AUTH).json()["servers"] == [{"url": "/api"}]
    with pytest.raises(httpx.TransportError):
        httpx.get(base_url.replace("https", "http") + "/health")


def _request_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pagedserve.api.requests"]


def test_request_log_lines(serve, caplog):
    caplog.set_level(logging.INFO, logger="pagedserve.api.requests")
    quiet, _ = serve(request_logger=RequestLogger())
    body = {"prompt": "Secret words", "max_tokens": 3, "ignore_eos": True, "n": 2}
    answer = httpx.post(f"{quiet}/v1/completions", json=body, timeout=60).json()
    assert wait_until(lambda: _request_lines(caplog), timeout=5)
    [line] = _request_lines(caplog)
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert f"{prompt_tokens} prompt + 6 completion tokens, finish length x2" in line and "Secret" not in line
    caplog.clear()
    verbose, _ = serve(request_logger=RequestLogger(log_prompts=True))
    answer = httpx.post(f"{verbose}/v1/completions", json={**body, "n": 1}, timeout=60).json()
    assert wait_until(lambda: _request_lines(caplog), timeout=5)
    [line] = _request_lines(caplog)
    assert "Secret words" in line and repr(answer["choices"][0]["text"])[1:-1] in line
    caplog.clear()
    assert httpx.post(f"{serve()[0]}/v1/completions", json=body, timeout=60).status_code == 200  # no logger
    assert not _request_lines(caplog)


def test_request_logger_line_format(caplog):
    caplog.set_level(logging.INFO, logger="pagedserve.api.requests")
    RequestLogger().log_request("r1", 5, 7, ["stop", "length", "length"], 0.25, prompt="hi", output="there")
    RequestLogger(log_prompts=True, max_log_len=4).log_request("r2", 5, 1, ["stop"], 1.0, prompt="abcdefgh",
                                                               output=[1, 2, 3, 4, 5])
    first, second = _request_lines(caplog)
    assert first == "request r1: 5 prompt + 7 completion tokens, finish stop, length x2, 0.250 s"
    assert second.endswith("finish stop, 1.000 s, prompt: 'abcd...', output: [1, 2, 3, 4, '...']")


def test_generation_defaults_fill_what_a_request_leaves_out(serve):
    base_url, _ = serve(generation_defaults={"temperature": 0.0, "max_tokens": 4})
    chat = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": HELLO, "ignore_eos": True}, timeout=60)
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 4
    body = {"prompt": "Once upon", "max_tokens": 8, "ignore_eos": True}
    greedy = httpx.post(f"{base_url}/v1/completions", json={**body, "temperature": 0.0}, timeout=60).json()
    defaulted = [httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json() for _ in range(2)]
    assert [d["choices"][0]["text"] for d in defaulted] == [greedy["choices"][0]["text"]] * 2
    hot = httpx.post(f"{base_url}/v1/completions", json={**body, "temperature": 1.0, "seed": 1}, timeout=60).json()
    assert hot["choices"][0]["text"] != greedy["choices"][0]["text"]  # a request's own value wins



def test_the_gateway_process_loads_the_tokenizer_folder_it_is_given(engine_address, llama_model, tmp_path):
    """`python -m frontend.api.server --tokenizer FOLDER`: the tokenizer (here: its chat template) comes from there."""
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((Path(llama_model) / "tokenizer.json").read_bytes())
    config = json.loads((Path(llama_model) / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    port = free_port()
    gateway = subprocess.Popen([sys.executable, "-m", "frontend.api.server", "--engine-address", engine_address,
                                "--model", llama_model, "--tokenizer", str(folder), "--port", str(port)], cwd=REPO)
    try:
        base_url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _answers(f"{base_url}/health"), timeout=120)
        expected = jinja2.Template(TEMPLATE).render(messages=HELLO, add_generation_prompt=True)
        tokens = httpx.post(f"{base_url}/tokenize", json={"messages": HELLO}).json()["tokens"]
        assert httpx.post(f"{base_url}/detokenize", json={"tokens": tokens}).json()["prompt"] == expected
        [model] = httpx.get(f"{base_url}/v1/models").json()["data"]
        assert model["id"] == model["root"] == llama_model
    finally:
        gateway.terminate()
        gateway.wait(timeout=60)  # uvicorn raises the SIGTERM again once it has shut down: -15


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False
