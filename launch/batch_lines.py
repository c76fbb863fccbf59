"""OpenAI batch files: an input line checked into a request, the output line for its answer or its error, and what
an earlier run's output already holds."""
from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("pagedserve.run_batch")
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


@dataclass(frozen=True)
class BatchRequest:
    line: int  # 1-based, in the input file
    custom_id: str
    url: str
    body: dict


class BadLine(Exception):
    """A line the batch cannot send; custom_id is None where the line has no usable one of its own."""

    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.custom_id = code, message, custom_id


def parse_line(text: bytes, line: int, seen: dict[str, int]) -> BatchRequest:
    """The request on one input line; BadLine saying what is wrong with it. `seen`: the custom_ids of the lines
    before it, and their lines (this one's is added)."""
    try:
        record = json.loads(text)
    except ValueError as error:  # not JSON, or not UTF-8
        raise BadLine("invalid_json", f"line {line} is not a JSON object: {error}") from None
    if not isinstance(record, dict):
        raise BadLine("invalid_json", f"line {line} is not a JSON object")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadLine("missing_custom_id", f"line {line} has no custom_id (a non-empty string)")
    if custom_id in seen:  # its error line names no custom_id, so each custom_id has one answer in the output
        raise BadLine("duplicate_custom_id", f"custom_id {custom_id!r} is also on line {seen[custom_id]}")
    seen[custom_id] = line
    if record.get("method") != "POST":
        raise BadLine("invalid_method", f"method {record.get('method')!r} is not supported; only POST", custom_id)
    url = record.get("url")
    if url not in ROUTES:
        raise BadLine("invalid_url", f"url {url!r} is not supported; one of {', '.join(ROUTES)}", custom_id)
    body = record.get("body")
    if not isinstance(body, dict):
        raise BadLine("invalid_body", "body must be a JSON object (the request to send to url)", custom_id)
    if body.get("stream"):
        raise BadLine("invalid_body", "stream is not supported in a batch: each line gets one whole response",
                      custom_id)
    return BatchRequest(line, custom_id, url, body)


def plan(texts: list[bytes], done: Done) -> tuple[list[BatchRequest], list[dict], int]:
    """The requests to send and the error lines to write for the input lines (blank ones aside) not yet in the
    output, and how many are there already."""
    requests, errors, seen, skipped = [], [], {}, 0
    for number, text in enumerate(texts, 1):
        if not text.strip():
            continue
        try:
            request = parse_line(text, number, seen)
            key, record = request.custom_id, None
        except BadLine as problem:
            request, record = None, bad_line(problem, number)
            key = number if problem.custom_id is None else problem.custom_id
        if key in done:
            skipped += 1
        elif request is not None:
            requests.append(request)
        else:
            errors.append(record)
    return requests, errors, skipped


def answer_line(request: BatchRequest, status: int, body: dict) -> dict:
    """The output line for the route's answer: a result (2xx), else an error line that keeps the response."""
    request_id = body.get("id") if isinstance(body.get("id"), str) else f"req_{uuid.uuid4().hex}"
    record = _output_line(request.custom_id, {"status_code": status, "request_id": request_id, "body": body})
    if status >= 400:
        error = body.get("error") if isinstance(body.get("error"), dict) else {}
        record["error"] = {"code": error.get("code") or str(status), "message": error.get("message") or str(body),
                           "line": request.line}
    return record


def bad_line(problem: BadLine, line: int) -> dict:
    return {**_output_line(problem.custom_id, None), "error": {"code": problem.code, "message": problem.message,
                                                               "line": line}}


def _output_line(custom_id: str | None, response: dict | None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": None}


@dataclass
class Done:
    """What an earlier run's output holds: answered custom_ids, and the input lines answered without one."""
    custom_ids: set[str] = field(default_factory=set)
    lines: set[int] = field(default_factory=set)

    def __contains__(self, key: str | int) -> bool:
        return key in (self.lines if isinstance(key, int) else self.custom_ids)


def read_done(path: Path) -> Done:
    """The output lines already in `path`; a torn last line (a killed run's) is cut off, to be run again.
    ValueError if a whole line is not a batch output line: then this is not our output, and appending to it
    would mix two files."""
    done = Done()
    if not path.exists():
        return done
    with path.open("r+b") as file:
        data = file.read()
        complete = data.rfind(b"\n") + 1
        if complete < len(data):
            logger.warning("%s: its last line is incomplete (an interrupted run); it is run again", path)
            file.truncate(complete)
    for number, text in enumerate(data[:complete].splitlines(), 1):
        try:
            record = json.loads(text)
            custom_id = record["custom_id"]
            line = None if custom_id is not None else record["error"]["line"]
        except (ValueError, TypeError, KeyError):
            raise ValueError(f"{path}, line {number}: not a batch output line; name a new output file") from None
        if line is None:
            done.custom_ids.add(custom_id)
        else:
            done.lines.add(line)
    return done
