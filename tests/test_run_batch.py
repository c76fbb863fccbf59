"""`python -m launch run-batch`: an OpenAI batch file through the gateway's routes, bad lines, resuming."""
from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from openai.types import BatchError, Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from launch.batch_lines import BadLine, BatchRequest, parse_line, read_done
from launch.run_batch import EngineGone, run
from launch.shipped import DEMO_MODEL_NAME

REPO = Path(__file__).resolve().parents[1]
GOOD_LINES = 195
MAX_TOKENS = 4
BAD = {  # input line number (1-based) -> (the line, its error code, the custom_id its error line names)
    7: ("{not json", "invalid_json", None),
    40: (json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}}), "invalid_method",
         "get"),
    80: (json.dumps({"custom_id": "images", "method": "POST", "url": "/v1/images/generations", "body": {}}),
         "invalid_url", "images"),
    120: (json.dumps({"custom_id": "line-3", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
          "duplicate_custom_id", None),
    160: (json.dumps({"custom_id": "refused", "method": "POST", "url": "/v1/completions",
                      "body": {"prompt": "x", "max_tokens": "many"}}), None, "refused"),  # the route's 400
}


def _good_line(index: int) -> str:
    if index == 100:  # the demo model serves embeddings too (its last hidden state): the route's answer stands
        url, body = "/v1/embeddings", {"input": "hello"}
    elif index % 2:
        url, body = "/v1/chat/completions", {"model": DEMO_MODEL_NAME, "max_tokens": MAX_TOKENS,
                                             "messages": [{"role": "user", "content": f"What is {index}?"}]}
    else:
        url, body = "/v1/completions", {"prompt": f"def f{index}(x):", "max_tokens": MAX_TOKENS}
    return json.dumps({"custom_id": f"line-{index}", "method": "POST", "url": url, "body": body})


def _batch_file() -> bytes:
    good = iter(range(1, GOOD_LINES + 1))
    lines = [BAD[number][0] if number in BAD else _good_line(next(good))
             for number in range(1, GOOD_LINES + len(BAD) + 1)]
    return ("\n".join(lines) + "\n").encode()


def _run_batch(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch", "run-batch", *args], check=False, cwd=REPO,
                          input=stdin, capture_output=True, timeout=300)


def _check_answer(record: dict) -> None:
    assert record["error"] is None and record["response"]["status_code"] == 200, record
    body = record["response"]["body"]
    assert record["response"]["request_id"] == body["id"] and record["id"].startswith("batch_req_")
    if body["object"] == "chat.completion":
        choice = ChatCompletion.model_validate(body).choices[0]
        assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    elif body["object"] == "text_completion":
        assert isinstance(Completion.model_validate(body).choices[0].text, str)
    else:
        assert record["custom_id"] == "line-100"
        assert len(CreateEmbeddingResponse.model_validate(body).data[0].embedding) > 1
        return
    assert body["model"] == DEMO_MODEL_NAME and 1 <= body["usage"]["completion_tokens"] <= MAX_TOKENS


def _check_error(record: dict) -> None:
    error = BatchError.model_validate(record["error"])
    _, code, custom_id = BAD[error.line]
    assert record["custom_id"] == custom_id
    if code is not None:
        assert error.code == code and record["response"] is None
    else:  # refused by the route: its status and error body are kept
        assert record["response"]["status_code"] == 400
        assert record["response"]["body"]["error"]["param"] == "max_tokens" == error.message.split(":")[0]


def _keys(lines: list[str]) -> Counter:
    """Output lines per input line: by custom_id, or by line number where the error line names none."""
    return Counter(record["custom_id"] or record["error"]["line"] for record in map(json.loads, lines))


def test_batch_with_bad_lines_then_resume_after_a_kill(tmp_path):
    """200 lines with 5 bad ones: stdout gets 195 answers and 5 error lines; then an output cut after 60 lines, mid
    line, as a killed run leaves it, is completed from stdin without repeating a line; a third run has nothing
    to do."""
    batch = tmp_path / "in.jsonl"
    batch.write_bytes(_batch_file())
    first = _run_batch("-i", str(batch), "-o", "-", "--max-model-len", "256")
    assert first.returncode == 0, first.stderr.decode()[-3000:]
    lines = first.stdout.decode().splitlines()  # nothing but output lines on stdout
    records = [json.loads(line) for line in lines]
    answers = [record for record in records if record["error"] is None]
    errors = [record for record in records if record["error"] is not None]
    assert len(answers) == GOOD_LINES and len(errors) == len(BAD)
    for record in answers:
        _check_answer(record)
    for record in errors:
        _check_error(record)
    assert sorted(record["error"]["line"] for record in errors) == sorted(BAD)
    assert _keys(lines) == Counter({**{f"line-{i}": 1 for i in range(1, GOOD_LINES + 1)},
                                    "get": 1, "images": 1, "refused": 1, 7: 1, 120: 1})
    assert "200/200 lines (5 error(s))" in first.stderr.decode()

    output = tmp_path / "out.jsonl"
    output.write_text("\n".join(lines[:60]) + "\n" + lines[60][:25])
    second = _run_batch("-i", "-", "-o", str(output), stdin=batch.read_bytes())
    assert second.returncode == 0, second.stderr.decode()[-3000:]
    resumed = output.read_text().splitlines()
    assert resumed[:60] == lines[:60] and _keys(resumed) == _keys(lines)
    assert "140/140 lines" in second.stderr.decode()
    for record in map(json.loads, resumed[60:]):
        (_check_answer if record["error"] is None else _check_error)(record)

    third = _run_batch("-i", str(batch), "-o", str(output))
    assert third.returncode == 0 and output.read_text().splitlines() == resumed
    assert "200 line(s) already answered" in third.stderr.decode()


def test_an_output_file_that_is_not_a_batch_output_is_left_alone(tmp_path):
    batch, output = tmp_path / "in.jsonl", tmp_path / "notes.txt"
    batch.write_text(_good_line(1) + "\n")
    output.write_text("my notes\n")
    result = _run_batch("-i", str(batch), "-o", str(output))
    assert result.returncode == 2 and "not a batch output line" in result.stderr.decode()
    assert output.read_text() == "my notes\n"


@pytest.mark.parametrize("line, code", [
    (b"\xff\xfe", "invalid_json"), (b"[1, 2]", "invalid_json"),
    (b'{"custom_id": "", "method": "POST", "url": "/v1/completions", "body": {}}', "missing_custom_id"),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": "prompt"}', "invalid_body"),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"stream": true}}', "invalid_body"),
])
def test_lines_the_batch_cannot_send(line, code):
    with pytest.raises(BadLine) as problem:
        parse_line(line, 1, {})
    assert problem.value.code == code


def test_only_a_torn_last_line_is_cut_off(tmp_path):
    output = tmp_path / "out.jsonl"
    done_line = json.dumps({"id": "batch_req_1", "custom_id": "a", "response": None, "error": None})
    output.write_text(done_line + "\n" + done_line[:10])
    assert read_done(output).custom_ids == {"a"} and output.read_text() == done_line + "\n"


def _scripted_gateway(*statuses: int) -> FastAPI:
    """A stand-in for the gateway whose /v1/completions answers with each status in turn (500: a route's bug)."""
    app, answers = FastAPI(), iter(statuses)

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        status = next(answers)
        if status == 500:
            raise RuntimeError("a bug")
        code = {429: "overloaded", 503: "engine_dead"}.get(status)
        return JSONResponse({"id": "cmpl-1"} if code is None else {"error": {"code": code, "message": code}},
                            status_code=status)
    return app


def _run_lines(app: FastAPI, output: io.StringIO | None = None) -> list[dict]:
    output = output or io.StringIO()
    request = BatchRequest(1, "a", "/v1/completions", {"prompt": "x"})
    asyncio.run(run(app, [request], [], output, concurrency=4))
    return [json.loads(line) for line in output.getvalue().splitlines()]


def test_an_overloaded_engine_is_waited_for_a_bug_is_the_lines_error_a_dead_engine_stops_the_run():
    [answer] = _run_lines(_scripted_gateway(429, 429, 200))
    assert answer["error"] is None and answer["response"]["status_code"] == 200
    [error] = _run_lines(_scripted_gateway(500))
    assert error["custom_id"] == "a" and error["error"]["code"] == "500" and error["response"]["status_code"] == 500
    output = io.StringIO()
    with pytest.raises(EngineGone):
        _run_lines(_scripted_gateway(503), output)
    assert output.getvalue() == ""  # the line stays out of the output, for a rerun to answer
