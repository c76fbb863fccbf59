"""ZmqConnector's pull off the decode engine's loop (issue 57, item 3): while a request's KV is arriving from a
prefill engine that answers late, the decode engine's running streams keep their pace; the late blocks are then loaded
and the request's tokens are one engine's; a request aborted while its KV arrives ends once, holding nothing."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from conftest import long_context_llama, wait_until
from disagg_cases import GREEDY, long_prompt, run_alone, stopped
from frontend import LLM, SamplingParams
from ipc import EngineCoreRequest, FinishReason

STALL_S = 2.0  # how long the prefill engine is stopped while the decode engine pulls from it
STREAM = SamplingParams(temperature=0.0, max_tokens=30_000, ignore_eos=True)


@pytest.fixture(scope="module")
def group():
    """The 64k-context llama (a stream on it outlasts the stall on any machine), pulls waiting up to 30 s."""
    connector = {"kv_connector": "ZmqConnector", "kv_role": "kv_both", "kv_buffer_bytes": "128KiB",
                 "kv_pull_timeout_s": 30.0}
    llm = LLM(long_context_llama(), dtype="float32", data_parallel_size=2, kv_transfer_config=connector)
    yield llm
    llm.shutdown()


def _case(group, n: int) -> tuple:
    """(prefill engine, decode engine, prompt n, its tokens on the decode engine alone, its KV as the prefill engine
    sent it, the decode engine's stats before it is sent there, its prefix cache emptied: the transfer alone can give
    it the prompt's blocks)."""
    prefill, decode = group.client.clients
    ids = long_prompt(n)
    expected, _ = run_alone(decode, EngineCoreRequest(request_id=f"alone{n}", prompt_token_ids=ids,
                                                      sampling_params=GREEDY))
    sent = _prefilled(prefill, f"p{n}", ids)
    decode.call_utility("reset_prefix_cache")
    return prefill, decode, ids, expected, sent, decode.get_stats()


def _prefilled(prefill, request_id: str, ids: list[int]):
    one = SamplingParams(temperature=0.0, max_tokens=1)
    return run_alone(prefill, EngineCoreRequest(request_id=request_id, prompt_token_ids=ids, sampling_params=one,
                                                produce_kv=True))[1].kv_transfer_params


def _stalled(pid: int, seconds: float) -> threading.Timer:
    """The process stopped now, and again running after `seconds`."""
    os.kill(pid, signal.SIGSTOP)
    assert wait_until(lambda: stopped(pid), timeout=10)
    timer = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
    timer.start()
    return timer


def _stream_started(decode, request_id: str) -> None:
    decode.add_request(EngineCoreRequest(request_id=request_id, prompt_token_ids=long_prompt(9),
                                         sampling_params=STREAM))
    while not any(output.request_id == request_id for output in decode.get_outputs().outputs):
        pass


def _abort_stream(decode, request_id: str) -> None:
    decode.abort_requests([request_id])
    while not any(output.request_id == request_id and output.finish_reason is not None
                  for output in decode.get_outputs().outputs):
        pass


def test_a_late_producer_holds_back_only_its_own_request_and_its_blocks_are_loaded_when_they_come(group):
    prefill, decode, ids, expected, sent, before = _case(group, 0)
    _stream_started(decode, "stream")
    timer = _stalled(prefill.process.pid, STALL_S)
    try:
        added = time.monotonic()
        decode.add_request(EngineCoreRequest(request_id="late", prompt_token_ids=ids, sampling_params=GREEDY,
                                             kv_transfer_params=sent))
        stream_times, tokens = [added], []
        while True:
            batch = decode.get_outputs()
            now = time.monotonic()
            late = [output for output in batch.outputs if output.request_id == "late"]
            stream_times += [now] * any(output.request_id == "stream" for output in batch.outputs)
            tokens += [token for output in late for token in output.new_token_ids]
            if any(output.finish_reason is not None for output in late):
                break
        _abort_stream(decode, "stream")
    finally:
        timer.join()
    assert tokens == expected
    assert now - added >= STALL_S - 0.1  # it did wait for its producer
    gaps = [b - a for a, b in zip(stream_times, stream_times[1:])]
    assert max(gaps) < STALL_S / 2, max(gaps)  # the stream's tokens kept coming meanwhile
    assert sum(t < added + STALL_S - 0.1 for t in stream_times) > 10
    stats = decode.get_stats()
    assert stats.kv_transfer_blocks_received - before.kv_transfer_blocks_received == len(sent.slots) == 4
    assert stats.kv_transfer_recomputes == before.kv_transfer_recomputes


def test_a_request_aborted_while_its_kv_arrives_ends_once_and_holds_nothing(group):
    prefill, decode, ids, expected, sent, before = _case(group, 1)
    timer = _stalled(prefill.process.pid, 1.0)
    try:
        decode.add_request(EngineCoreRequest(request_id="gone", prompt_token_ids=ids, sampling_params=GREEDY,
                                             kv_transfer_params=sent))
        assert wait_until(lambda: decode.get_stats().num_waiting == 1, timeout=5)  # waiting for its KV
        decode.abort_requests(["gone"])
        finals = [output.finish_reason for output in decode.get_outputs().outputs]
        assert finals == [FinishReason.ABORT]
    finally:
        timer.join()
    time.sleep(0.5)  # the producer answers the pull: the decode engine drops the answer
    stats = decode.get_stats()
    assert stats.num_free_blocks == decode.info.num_kv_blocks and stats.num_running == stats.num_waiting == 0
    assert (stats.kv_transfer_blocks_received, stats.kv_transfer_recomputes) == \
        (before.kv_transfer_blocks_received, before.kv_transfer_recomputes)
    decode.call_utility("reset_prefix_cache")
    again = _prefilled(prefill, "p1again", ids)
    got, _ = run_alone(decode, EngineCoreRequest(request_id="again", prompt_token_ids=ids, sampling_params=GREEDY,
                                                 kv_transfer_params=again))  # no second output of "gone" comes
    assert got == expected and decode.get_stats().kv_transfer_blocks_received == \
        before.kv_transfer_blocks_received + len(again.slots)
