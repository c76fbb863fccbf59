"""Hostile constraints cannot deny structured output to others: huge schemas time out and their compile is
stopped (its worker process killed), small constraints compile at once beside them, and constraints that allow no
output are the client's error."""
from __future__ import annotations

import asyncio
import os
import time

import httpx
import psutil
import pytest

from conftest import AUTH, long_context_llama, wait_until
from launcher import start_launcher, stop_launcher
from core.engine_core import EngineCore
from ipc import EngineConfig, EngineCoreRequest, FinishReason, SamplingParams, StructuredOutputsParams


def _huge_schema(tag: int, properties: int = 5000) -> dict:
    return {"type": "object", "title": f"hostile-{tag}-{time.time_ns()}",
            "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}


def _compile_workers(engine: EngineCore) -> list[psutil.Process]:
    """The pool's live compile workers (one that exits while they are listed is left out)."""
    workers = []
    for lane in engine.structured.compiler.pool.lanes:
        if lane.process is not None and lane.process.poll() is None:
            try:
                workers.append(psutil.Process(lane.process.pid))
            except psutil.NoSuchProcess:
                pass
    return workers


def _run(engine: EngineCore, requests: dict[str, StructuredOutputsParams]) -> dict[str, tuple[object, float]]:
    """Each request's final output and the seconds it took, all added at once."""
    start = time.monotonic()
    for request_id, constraint in requests.items():
        params = SamplingParams(structured_outputs=constraint, max_tokens=16, temperature=0.0)
        engine.add_request(EngineCoreRequest(request_id=request_id, prompt_token_ids=[5, 6, 7],
                                             sampling_params=params))
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finish_reason is not None:
                assert output.request_id not in finals
                finals[output.request_id] = output, time.monotonic() - start
    return finals


@pytest.fixture(scope="module")
def engine(llama_model):
    engine = EngineCore(EngineConfig(model=llama_model, dtype="float32", max_model_len=256, num_kv_blocks=64,
                                     structured_outputs_compile_timeout=3.0))
    assert engine.structured.compiler.tables_ready.wait(120)
    yield engine
    engine.shutdown()


def test_huge_schemas_time_out_and_stop_while_small_constraints_compile_at_once(engine):
    workers_before = {p.pid for p in _compile_workers(engine)}
    hostile = {f"huge-{i}": StructuredOutputsParams(json=_huge_schema(i)) for i in range(4)}
    trivial = {f"small-{i}": StructuredOutputsParams(choice=[f"yes{i}", "no"]) if i % 2 else
               StructuredOutputsParams(regex=f"[a-c]{{{i % 3 + 1}}}x") for i in range(20)}
    finals = _run(engine, {**hostile, **trivial})
    for request_id in trivial:
        output, seconds = finals[request_id]
        assert output.finish_reason == FinishReason.STOP and seconds < 2.0, (request_id, output, seconds)
    for request_id in hostile:
        output, seconds = finals[request_id]
        assert output.error_kind == "invalid" and "took longer than 3 s to compile" in output.error
    # The worker that compiled a huge schema was killed and replaced; nothing compiles any more.
    assert wait_until(lambda: {p.pid for p in _compile_workers(engine)} - workers_before, timeout=30)
    assert engine.structured.compiler.pool.wait_ready(timeout=60) and len(_compile_workers(engine)) == 2
    time.sleep(1.0)
    busy = [p.cpu_percent(interval=None) for p in _compile_workers(engine)]
    time.sleep(1.0)
    busy = [p.cpu_percent(interval=None) for p in _compile_workers(engine)]
    assert max(busy) < 10.0, busy
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_a_constraint_that_timed_out_fails_at_once_when_sent_again(engine):
    schema = StructuredOutputsParams(json=_huge_schema(99))
    [(first, first_s)] = _run(engine, {"first": schema}).values()
    [(again, again_s)] = _run(engine, {"again": schema}).values()
    assert "took longer than" in first.error and first_s >= 3.0
    assert again.error == first.error and again_s < 1.0


@pytest.mark.parametrize("constraint", [
    {"json": {"$ref": "#"}},
    {"json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
    {"grammar": "root ::= a\na ::= root"},
])
def test_a_constraint_that_allows_no_output_is_the_clients_error(engine, constraint):
    [(output, _)] = _run(engine, {"r": StructuredOutputsParams(**constraint)}).values()
    assert output.finish_reason == FinishReason.ERROR and output.error_kind == "invalid", output
    # ours after compiling, or xgrammar's own refusal to compile (0.2.9 finds circular $ref chains itself)
    assert "allows no output" in output.error or "Circular $ref chain" in output.error, output.error


def test_a_recursive_schema_with_a_way_out_compiles(engine):
    tree = {"type": "object", "properties": {"leaf": {"type": "integer"},
                                             "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
            "required": ["leaf"]}
    [(output, _)] = _run(engine, {"r": StructuredOutputsParams(json=tree)}).values()
    assert output.error is None, output


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


@pytest.mark.parametrize("path,fields", [
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}}),
    ("/v1/completions", {"structured_outputs": {"json": CYCLE}}),
    ("/v1/completions", {"guided_grammar": "root ::= a\na ::= root"}),
    ("/v1/chat/completions", {"tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": CYCLE}, "required": ["x"]}}}]}),
])
def test_constraints_that_lead_nowhere_are_400s_naming_the_field(server, llama_model, path, fields):
    body = {"model": llama_model, "max_tokens": 40, "temperature": 0, **fields}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    response = httpx.post(server[1] + path, json=body, headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "structured_outputs", response.text
    assert httpx.get(server[1] + "/health").status_code == 200


def test_a_client_over_its_concurrency_budget_gets_429s_while_others_are_served(llama_model):
    process, base_url = start_launcher(["--model", long_context_llama(), "--dtype", "float32",
                                        "--max-concurrent-requests-per-key", "2", "--kv-cache-memory", "40MiB"])
    slow = {"prompt": "hi", "max_tokens": 60000, "ignore_eos": True, "stream": True}
    try:
        async def scenario():
            greedy = {"Authorization": "Bearer greedy"}
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
                streams = [await http.send(http.build_request("POST", "/v1/completions", json=slow, headers=greedy),
                                           stream=True) for _ in range(2)]
                over = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=greedy)
                other = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                        headers={"Authorization": "Bearer modest"})
                for stream in streams:
                    await stream.aclose()
                return [s.status_code for s in streams], over, other
        statuses, over, other = asyncio.run(scenario())
        assert statuses == [200, 200] and other.status_code == 200, other.text
        assert over.status_code == 429 and over.json()["error"]["code"] == "too_many_requests", over.text
        # Both streams ended (the client closed them): the greedy client's budget is back.
        assert wait_until(lambda: httpx.post(base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                             headers={"Authorization": "Bearer greedy"}).status_code == 200, 10)
    finally:
        stop_launcher(process)


def test_the_first_constrained_requests_start_the_workers_and_do_not_wait_for_them(llama_model):
    """No compile worker runs before a constraint arrives (their imports would take CPU from plain requests' steps);
    the first constraints start them, and small ones compile in the engine itself while the workers import."""
    engine = EngineCore(EngineConfig(model=llama_model, dtype="float32", max_model_len=256, num_kv_blocks=64))
    try:
        engine.add_request(EngineCoreRequest(request_id="plain", prompt_token_ids=[5, 6, 7],
                                             sampling_params=SamplingParams(max_tokens=4, temperature=0.0)))
        while engine.has_unfinished_requests():
            engine.step()
        assert engine._structured is None  # no workers, no vocabulary tables
        finals = _run(engine, {f"r{i}": StructuredOutputsParams(choice=[f"yes{i}", "no"]) for i in range(4)})
        assert all(output.finish_reason == FinishReason.STOP and seconds < 2.0 for output, seconds in finals.values())
        # ... and, importing, they take only CPU time the engine leaves idle: never its neighbour.
        assert wait_until(lambda: len(_compile_workers(engine)) == 2, timeout=5)
        assert {os.sched_getscheduler(worker.pid) for worker in _compile_workers(engine)} == {os.SCHED_IDLE}
    finally:
        engine.shutdown()
