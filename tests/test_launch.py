"""The command line serves a model over HTTP: a given folder (`pagedserve serve MODEL`, `--model MODEL`), or the
built-in demo model when none is given; vLLM's flags reach the engine and the gateways."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import jinja2
import pytest

from conftest import API_KEY, AUTH, wait_until
from frontend.tokenizer import load_tokenizer
from launch.launch import DEMO_MODEL_NAME, build_parser, engine_config, main
from launcher import REPO, descendants, engine_pid, free_port, running, start_launcher, stop_launcher

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\\n{% endfor %}ASSISTANT:"


def _start_printing(args: list[str], env: dict[str, str], as_script: bool = False):
    """(process, base URL, stdout lines so far): a launcher whose stdout is read, once it has printed its curl line."""
    port = free_port()
    entry = ["launch/launch.py"] if as_script else ["-m", "launch"]
    process = subprocess.Popen([sys.executable, *entry, *args, "--port", str(port)], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
    threading.Thread(target=read, daemon=True).start()
    ready = wait_until(lambda: process.poll() is not None or any(line.startswith("curl ") for line in lines), 300)
    if not ready or process.poll() is not None:
        process.kill()
        raise RuntimeError(f"the launcher exited ({process.returncode}) or printed no curl line: {lines}")
    return process, f"http://127.0.0.1:{port}", lines


def _run_curl(lines: list[str], env: dict[str, str]) -> dict:
    """Run the printed curl line as a user would paste it into a shell; its JSON answer."""
    [line] = [line for line in lines if line.startswith("curl ")]
    result = subprocess.run(["bash", "-c", line + " --silent --show-error"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_launch_without_model_serves_the_trained_demo_model(tmp_path):
    """Started the way the issue writes it, `python launch/launch.py` (the other tests use `python -m launch`)."""
    env = {**os.environ, "PAGEDSERVE_CACHE": str(tmp_path)}
    env.pop("PAGEDSERVE_API_KEY", None)
    process, base_url, lines = _start_printing([], env, as_script=True)
    try:
        assert not any(tmp_path.iterdir())  # the shipped weights: nothing built or downloaded
        [model] = httpx.get(f"{base_url}/v1/models").json()["data"]
        assert model["id"] == model["root"] == DEMO_MODEL_NAME  # not the folder
        completion = httpx.post(f"{base_url}/v1/completions", timeout=60, json={
            "prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0, "ignore_eos": True})
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 48
        code = completion.json()["choices"][0]["text"]
        assert code.startswith("\n    ") and any(word in code for word in ("return", "if ", "for ", '"""')), code
        curl_line = next(line for line in lines if line.startswith("curl "))
        assert f"{base_url}/v1/chat/completions" in curl_line and "Authorization" not in curl_line  # no key set
        answer = _run_curl(lines, env)
        assert answer["model"] == DEMO_MODEL_NAME and answer["choices"][0]["message"]["role"] == "assistant"
        # Tools with OpenAI's default tool_choice ("auto"): served for the demo, whose template writes hermes calls.
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        chat = httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool], "max_tokens": 16})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    finally:
        assert stop_launcher(process) == 0


def test_serve_model_with_vllm_flags(llama_model, tmp_path):
    """`serve MODEL` and the flags: each reaches the engine or the gateway and does what it says."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "temperature": 0.0}))
    env = {name: value for name, value in os.environ.items() if name != "PAGEDSERVE_API_KEY"}
    process, base_url, lines = _start_printing(
        ["serve", llama_model, "--api-key", API_KEY, "--dtype", "float32", "--max-model-len", "256",
         "--chat-template", TEMPLATE, "--generation-config", str(tmp_path), "--max-logprobs", "3",
         "--no-enable-prefix-caching", "--allowed-origins", '["http://app.example"]'], env)
    try:
        assert API_KEY not in "\n".join(lines) and "$PAGEDSERVE_API_KEY" in lines[-1]
        assert _run_curl(lines, {**env, "PAGEDSERVE_API_KEY": API_KEY})["object"] == "chat.completion"
        models = httpx.get(f"{base_url}/v1/models", headers={**AUTH, "Origin": "http://app.example"})
        assert models.headers["access-control-allow-origin"] == "http://app.example"
        [model] = models.json()["data"]
        assert model["id"] == model["root"] == llama_model and model["parent"] is None
        messages = [{"role": "user", "content": "Hi"}]
        expected = load_tokenizer(llama_model).encode(
            jinja2.Template(TEMPLATE.replace("\\n", "\n")).render(messages=messages), add_special_tokens=False)
        tokenized = httpx.post(f"{base_url}/tokenize", headers=AUTH, json={"messages": messages})
        assert tokenized.json()["tokens"] == expected
        body = {"prompt": "word " * 40, "max_tokens": 2}
        for _ in range(2):
            assert httpx.post(f"{base_url}/v1/completions", headers=AUTH, json={**body, "logprobs": 3}).is_success
        over = httpx.post(f"{base_url}/v1/completions", headers=AUTH, json={**body, "logprobs": 4})
        assert over.status_code == 400 and over.json()["error"]["param"] == "logprobs"
        metrics = httpx.get(f"{base_url}/metrics", headers=AUTH).text
        assert [line for line in metrics.splitlines() if line.startswith("pagedserve:prefix_cache_hits_total{")
                and not line.endswith(" 0.0")] == []  # the same prompt twice, and no prefix cache
        chat = httpx.post(f"{base_url}/v1/chat/completions", headers=AUTH, timeout=60,
                          json={"messages": messages, "ignore_eos": True})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3  # max_new_tokens
    finally:
        assert stop_launcher(process) == 0


def test_command_line_forms_and_engine_flags():
    parser = build_parser()
    config = engine_config(parser.parse_args(["--max-logprobs", "5", "--no-enable-prefix-caching"]), "m")
    assert config.max_logprobs == 5 and config.enable_prefix_caching is False
    assert engine_config(parser.parse_args([]), "m").enable_prefix_caching is True
    config = engine_config(parser.parse_args(["--structured-outputs-compile-timeout", "2.5", "--tokenizer", "t"]), "m")
    assert config.structured_outputs_compile_timeout == 2.5 and config.tokenizer == "t"
    spec = '{"method": "ngram", "num_speculative_tokens": 5}'
    config = engine_config(parser.parse_args(["--speculative-config", spec]), "m")
    assert config.speculative_config.num_speculative_tokens == 5 and config.speculative_config.method == "ngram"
    assert engine_config(parser.parse_args([]), "m").speculative_config is None
    assert parser.parse_args(["/models/x", "--port", "1"]).model_tag == "/models/x"
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/models/a", "--model", "/models/b"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("flags, message", [
    (["--chat-template", "/no/such/template.jinja"], "looks like a file path"),
    (["--chat-template", "{% if %}"], "not valid Jinja"),
    (["--generation-config", "/no/such/folder"], "generation_config.json"),
])
def test_bad_gateway_flags_fail_before_anything_starts(flags, message, capsys):
    assert main(["serve", "/models/unused", *flags]) == 2
    assert message in capsys.readouterr().err


def test_launch_reports_bad_arguments(llama_model):
    result = subprocess.run([sys.executable, "-m", "launch", "--model", llama_model, "--tp", "0"], cwd=REPO,
                            env=os.environ, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and "tensor_parallel_size" in result.stderr


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])
def test_operator_stop_after_an_engine_crash_exits_0(llama_model, stop_signal):
    """The gateways outlive a crashed engine core (503s by design); the operator's stop is still a clean one."""
    process, base_url = start_launcher(["--model", llama_model])
    try:
        children = descendants(process.pid)
        os.kill(engine_pid(process.pid), signal.SIGKILL)
        assert wait_until(lambda: httpx.get(f"{base_url}/health").status_code == 503, timeout=10)
        process.send_signal(stop_signal)
        assert process.wait(timeout=60) == 0
        # The engine's compile workers die with it and wait, as zombies, for init to reap them.
        assert wait_until(lambda: not [pid for pid, _ in children if running(pid)], timeout=10)
    finally:
        stop_launcher(process)
