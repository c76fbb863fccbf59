"""The engine core's sockets: several clients, malformed frames, CURVE, loopback by default, no pickle."""
from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
import textwrap
import time
import uuid

import msgspec
import pytest
import zmq
import zmq.auth

from conftest import random_prompts
from core import engine_clients
from core.engine_spawn import EngineProcess
from frontend import LLM, EngineCoreClient, SamplingParams
from ipc import (AbortRequests, Decoder, EngineConfig, EngineCoreOutputs, EngineCoreRequest, SubscribeHeartbeats,
                 UtilityCall)
from ipc.sockets import EngineEndpoints, check_binding_is_safe, connect_dealer, free_tcp_address

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


_CLIENT = textwrap.dedent("""
    import json, sys
    from frontend import EngineCoreClient
    from ipc import EngineCoreRequest, SamplingParams
    client = EngineCoreClient(sys.argv[1])
    prompts = json.loads(sys.argv[2])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, prompt in enumerate(prompts):  # the same request ids in every client
        client.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params))
    tokens, done = {}, set()
    while len(done) < len(prompts):
        for output in client.get_outputs().outputs:
            assert output.request_id not in done, "an output after the final one"
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                done.add(output.request_id)
    print(json.dumps(tokens))
    client.shutdown()
""")


def test_two_client_processes_each_get_exactly_their_own_outputs(engine_address, llama_model):
    prompt_sets = [random_prompts([5, 12, 30, 7], vocab=1000, seed=seed) for seed in (1, 2)]
    clients = [subprocess.Popen([sys.executable, "-c", _CLIENT, engine_address, json.dumps(prompts)],
                                stdout=subprocess.PIPE, text=True) for prompts in prompt_sets]
    received = [json.loads(client.communicate(timeout=120)[0]) for client in clients]
    assert all(client.returncode == 0 for client in clients)
    reference = LLM(llama_model, dtype="float32", in_process=True)
    for prompts, tokens in zip(prompt_sets, received):
        expected = reference.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert tokens == {f"r{i}": o.outputs[0].token_ids for i, o in enumerate(expected)}


def _raw_dealer(address: str) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    context, identity = zmq.Context(), uuid.uuid4().bytes
    endpoints = EngineEndpoints.from_address(address)
    return (context, connect_dealer(context, endpoints.input, identity, None),
            connect_dealer(context, endpoints.output, identity, None))


_HELLO = 2**40  # call ids of handshake calls, told apart from the test's own


def _handshake(sock_in: zmq.Socket, sock_out: zmq.Socket) -> None:
    """Say hello until the engine answers, as the client library does: the engine's ROUTER drops replies to a
    client whose output connection is not up yet. The answers are left for _replies to skip."""
    for attempt in range(30):
        sock_in.send(msgspec.msgpack.encode(UtilityCall(call_id=_HELLO + attempt, method="get_info")))
        if sock_out.poll(1000):
            return
    raise AssertionError("the engine never answered the handshake")


def _replies(output: zmq.Socket, count: int, counted=lambda reply: 1) -> list[EngineCoreOutputs]:
    """The next replies (heartbeats and handshake answers skipped) until `counted` of them adds up to count."""
    decoder = Decoder(EngineCoreOutputs)
    replies, total = [], 0
    deadline = time.monotonic() + 120
    while total < count:
        assert output.poll(10_000) and time.monotonic() < deadline, "the engine did not answer"
        reply = decoder.decode(output.recv_multipart())
        if reply.heartbeat is not None:
            continue
        if reply.utility_result is None or reply.utility_result.call_id < _HELLO:  # not a (late) handshake answer
            replies.append(reply)
            total += counted(reply)
    return replies


def test_malformed_frames_are_answered_and_the_engine_keeps_serving(engine_address):
    context, sock_in, sock_out = _raw_dealer(engine_address)
    try:
        _handshake(sock_in, sock_out)  # proves our output route exists before the junk goes in
        bad_params = {"type": "add", "request_id": "bad-temp", "prompt_token_ids": [1, 2],
                      "sampling_params": {"temperature": -1.0}}
        junk = [[os.urandom(64)], [msgspec.msgpack.encode(bad_params)[:-3]], [msgspec.msgpack.encode(bad_params)],
                [msgspec.msgpack.encode({"type": "nonsense"})], [b""], [msgspec.msgpack.encode([1, 2, 3])],
                [msgspec.msgpack.encode({"type": "utility", "call_id": 9, "method": 5})],
                [msgspec.msgpack.encode({"type": "add", "request_id": "ext", "prompt_token_ids":
                                         msgspec.msgpack.Ext(1, msgspec.msgpack.encode(("int64", [2], 7))),
                                         "sampling_params": {}})]]
        # The fuzzing run's repro: well-typed, and it used to kill the engine with an IndexError in a worker.
        junk += [[msgspec.msgpack.encode({"type": "add", "request_id": "empty-bad-word", "prompt_token_ids": [1, 2],
                                          "sampling_params": {"max_tokens": 4, "bad_words_token_ids": [[]]}})]]
        rng = random.Random(0)
        junk += [[rng.randbytes(rng.randrange(1, 200))] for _ in range(300)]  # random bytes trip many paths
        junk += [[msgspec.msgpack.encode(bad_params), rng.randbytes(16)]]  # an extra frame nobody refers to
        for frames in junk:
            sock_in.send_multipart(frames)
        replies = _replies(sock_out, len(junk))
        errors = [e for r in replies for e in r.errors]
        assert len(errors) + sum(r.utility_result is not None for r in replies) == len(junk)
        assert all(e.message.startswith("malformed message") for e in errors)
        by_id = {e.request_id: e.message for e in errors}
        assert "temperature" in by_id["bad-temp"] and "ext" in by_id
        assert "bad_words_token_ids" in by_id["empty-bad-word"]
        assert [r.utility_result.call_id for r in replies if r.utility_result] == [9]
        good = EngineCoreRequest(request_id="good", prompt_token_ids=[3, 4, 5], sampling_params=GREEDY)
        sock_in.send(msgspec.msgpack.encode(good))
        outputs = []
        while not outputs or outputs[-1].finish_reason is None:
            outputs.extend(_replies(sock_out, 1)[0].outputs)
        assert sum(len(o.new_token_ids) for o in outputs) == 10
    finally:
        context.destroy(linger=0)


_ABSURD = [-(2**63), -(2**31) - 1, -2, -1, 0, 1, 2**31, 2**63 - 1, 2**64 - 1, float("nan"), float("inf"),
           float("-inf"), 1e308, -0.0, 5e-324, "", "x" * 5000, "\u00e9\u0000", [], [[]], [-1], [2**40], {}, {"1": 2},
           {1: float("inf")}, None, True, b"\xff"]
_REQUEST_FIELDS = ["request_id", "prompt_token_ids", "eos_token_id", "arrival_time", "priority", "cache_salt"]


def _fuzz_message(rng: random.Random, index: int) -> tuple[list[bytes], bool, object]:
    """One message for the engine, whether it must be answered (every kind but an abort is), and the request id
    it may have started."""
    kind = rng.random()
    if kind < 0.3:
        return [rng.randbytes(rng.randrange(0, 300))], True, None
    if kind < 0.35:
        return [msgspec.msgpack.encode(AbortRequests([f"f{rng.randrange(index + 1)}"]))], False, None
    if kind < 0.45:
        method = rng.choice(["get_stats", "get_info", "check_health", "start_profile", "stop_profile",
                             "reset_prefix_cache", "shutdown", "__init__", "step", "x" * 100])
        args = [rng.choice(_ABSURD) for _ in range(rng.randrange(3))]
        body = msgspec.msgpack.encode({"type": "utility", "call_id": index, "method": method, "args": args})
        return [body], True, None
    params = {"max_tokens": 2, **({"temperature": 0.0} if rng.random() < 0.5 else {})}
    request = {"type": "add", "request_id": f"f{index}", "prompt_token_ids": [1, 2, 3], "sampling_params": params}
    for _ in range(rng.randrange(1, 4)):  # well-typed or not, in range or not
        target, names = (request, _REQUEST_FIELDS) if rng.random() < 0.3 else (params, SamplingParams.__struct_fields__)
        target[rng.choice(names)] = rng.choice(_ABSURD)
    body = msgspec.msgpack.encode(request)
    return [body[:rng.randrange(len(body))] if rng.random() < 0.1 else body], True, request["request_id"]


def test_fuzzed_messages_never_kill_the_engine(engine_address):
    """Random, truncated and well-typed-but-absurd messages each get their one answer; the engine serves on."""
    count = int(os.environ.get("PAGEDSERVE_ZMQ_FUZZ_MESSAGES", "10000"))
    context, sock_in, sock_out = _raw_dealer(engine_address)
    try:
        _handshake(sock_in, sock_out)
        rng = random.Random(23)
        messages = [_fuzz_message(rng, index) for index in range(count)]
        for frames, _, _ in messages:
            sock_in.send_multipart(frames)
        # Whatever was accepted ends (some ask for 2**31 tokens): an abort for every request id the fuzz used.
        used = sorted({request_id for _, _, request_id in messages if isinstance(request_id, str)})
        sock_in.send(msgspec.msgpack.encode(AbortRequests(used)))
        expected = sum(answered for _, answered, _ in messages)
        assert sum(map(_answers, _replies(sock_out, expected, counted=_answers))) == expected
        good = EngineCoreRequest(request_id="good", prompt_token_ids=[3, 4, 5], sampling_params=GREEDY)
        sock_in.send(msgspec.msgpack.encode(good))
        outputs = []
        while not outputs or outputs[-1].finish_reason is None:
            outputs.extend(o for o in _replies(sock_out, 1)[0].outputs if o.request_id == "good")
        assert sum(len(o.new_token_ids) for o in outputs) == 10
    finally:
        context.destroy(linger=0)


def _answers(reply: EngineCoreOutputs) -> int:
    """Messages this reply ends: refusals, utility results and final outputs."""
    return len(reply.errors) + (reply.utility_result is not None) + sum(
        o.finish_reason is not None for o in reply.outputs)


def test_curve_refuses_a_wrong_key_and_serves_the_right_one(llama_model, tmp_path):
    key_file = zmq.auth.create_certificates(tmp_path, "engine")[1]
    wrong_key_file = zmq.auth.create_certificates(tmp_path, "intruder")[1]
    address = free_tcp_address()
    engine = EngineProcess(EngineConfig(model=llama_model, dtype="float32"), address, curve_key_file=key_file)
    try:
        engine.wait_ready()
        with pytest.raises((PermissionError, ConnectionError)):
            EngineCoreClient(address, curve_key_file=wrong_key_file, handshake_timeout=2)
        with pytest.raises((PermissionError, ConnectionError)):
            EngineCoreClient(address, handshake_timeout=2)  # no key at all
        llm = LLM(llama_model, engine_address=address, curve_key_file=str(key_file))
        [output] = llm.generate("secret", GREEDY, use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 10
        llm.shutdown()
        assert engine.is_alive()
    finally:
        engine.shutdown()


def test_beyond_loopback_needs_a_key():
    assert EngineEndpoints.from_address("tcp://127.0.0.1:5555").output == "tcp://127.0.0.1:5556"
    assert EngineEndpoints.from_address("ipc:///tmp/x").output == "ipc:///tmp/x.out"
    assert EngineEndpoints.from_address("tcp://[::1]:7000").is_loopback
    with pytest.raises(ValueError, match="CURVE key file"):
        check_binding_is_safe(EngineEndpoints.from_address("tcp://0.0.0.0:5555"), None)
    with pytest.raises(ValueError, match="CURVE key file"):
        check_binding_is_safe(EngineEndpoints.from_address("tcp://0.0.0.0:5555"), None, insecure_loopback=True)
    # Loopback tcp:// too: every user of the host reaches it. ipc:// is its owner's alone.
    with pytest.raises(ValueError, match="--engine-insecure-loopback"):
        check_binding_is_safe(EngineEndpoints.from_address("tcp://127.0.0.1:5555"), None)
    check_binding_is_safe(EngineEndpoints.from_address("tcp://127.0.0.1:5555"), None, insecure_loopback=True)
    check_binding_is_safe(EngineEndpoints.from_address("ipc:///tmp/x"), None)
    with pytest.raises(ValueError, match="tcp:// or ipc://"):
        EngineEndpoints.from_address("udp://127.0.0.1:1")


_PICKLE_GUARD = textwrap.dedent("""
    import os, pickle, traceback


    def _record(name):
        stack = traceback.format_stack()
        if any("importlib._bootstrap" in frame for frame in stack):
            return  # a library pickling a constant while it is imported, not a message
        with open(os.environ["PAGEDSERVE_PICKLE_LOG"], "a") as log:
            log.write(f"pickle.{name} used by pid {os.getpid()}:\\n{''.join(stack)}\\n")


    def _guard(name, function):
        def guarded(*args, **kwargs):
            _record(name)
            return function(*args, **kwargs)
        return guarded


    class _GuardedPickler(pickle.Pickler):
        def dump(self, obj):
            _record("Pickler.dump")
            return super().dump(obj)


    class _GuardedUnpickler(pickle.Unpickler):
        def load(self):
            _record("Unpickler.load")
            return super().load()


    for _name in ("dumps", "loads", "dump", "load"):
        setattr(pickle, _name, _guard(_name, getattr(pickle, _name)))
    pickle.Pickler, pickle.Unpickler = _GuardedPickler, _GuardedUnpickler
""")


def test_no_message_is_ever_pickled(llama_model, tmp_path, monkeypatch):
    """Both processes log every pickle use after imports (the engine through a sitecustomize); any fails."""
    (tmp_path / "sitecustomize.py").write_text(_PICKLE_GUARD)
    log = tmp_path / "pickle.log"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, getattr(pickle, name))  # restored after the test: the guard patches pickle
    exec(_PICKLE_GUARD, {})  # the same guard in this (front-end) process
    monkeypatch.setenv("PAGEDSERVE_PICKLE_LOG", str(tmp_path / "self-check.log"))
    pickle.loads(pickle.dumps(1))
    assert (tmp_path / "self-check.log").read_text().count("used by pid") == 2  # the guard does see pickle
    monkeypatch.setenv("PAGEDSERVE_PICKLE_LOG", str(log))
    llm = LLM(llama_model, dtype="float32")
    outputs = llm.generate(["no", "pickles", "here"], SamplingParams(max_tokens=5, logprobs=2), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 5 for o in outputs)
    assert llm.get_stats().num_running == 0
    llm.shutdown()
    assert not log.exists(), log.read_text()


def test_malformed_message_warnings_are_rate_limited_per_client(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(engine_clients.time, "monotonic", lambda: now[0])
    warnings = engine_clients.RateLimitedWarnings()
    with caplog.at_level("WARNING", logger="pagedserve.engine_core"):
        for _ in range(500):
            warnings.warn(b"a", ValueError("junk"))
        warnings.warn(b"b", ValueError("junk"))
        now[0] += engine_clients._WARNING_INTERVAL_S
        warnings.warn(b"a", ValueError("more junk"))
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "junk", "junk", "more junk (499 more since the last warning)"]


def test_heartbeats_arrive_twice_a_second_to_subscribers_and_tell_the_loop_age(engine_address):
    context, sock_in, sock_out = _raw_dealer(engine_address)
    decoder = Decoder(EngineCoreOutputs)
    try:
        _handshake(sock_in, sock_out)
        assert not sock_out.poll(1500) or decoder.decode(sock_out.recv_multipart()).heartbeat is None  # unasked
        sock_in.send(msgspec.msgpack.encode(SubscribeHeartbeats()))
        beats, started = [], time.monotonic()
        while time.monotonic() - started < 2.0:
            if sock_out.poll(100) and (reply := decoder.decode(sock_out.recv_multipart())).heartbeat is not None:
                beats.append(reply.heartbeat.loop_age)
        assert 3 <= len(beats) <= 5 and all(0 <= age < 1.0 for age in beats)  # an idle loop wakes every 0.2 s
    finally:
        context.destroy(linger=0)


def test_heartbeats_go_to_the_latest_subscribers(monkeypatch):
    monkeypatch.setattr(engine_clients, "_MAX_PEERS", 3)
    peers = engine_clients.Peers()
    for identity in (b"a", b"b", b"c", b"a", b"d"):  # b"b" is the one silent longest when b"d" arrives
        peers.heard_from(identity)
    assert peers.identities() == [b"c", b"a", b"d"]


_DOOMED_CLIENT = textwrap.dedent("""
    import sys, time
    from frontend import EngineCoreClient
    from ipc import EngineCoreRequest, SamplingParams
    client = EngineCoreClient(sys.argv[1])
    params = SamplingParams(max_tokens=60000, ignore_eos=True)
    for i in range(20):
        client.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=[5, 6, 7], sampling_params=params))
    print("sent", flush=True)
    time.sleep(600)  # killed long before
""")


def test_a_killed_clients_requests_are_aborted_within_two_seconds(tmp_path):
    from conftest import long_context_llama

    address = f"ipc://{tmp_path}/engine"
    engine = EngineProcess(EngineConfig(model=long_context_llama(), dtype="float32", kv_cache_memory="64MiB"),
                           address)
    engine.wait_ready()
    survivor = EngineCoreClient(address)
    try:
        params = SamplingParams(max_tokens=60000, ignore_eos=True)
        survivor.add_request(EngineCoreRequest(request_id="mine", prompt_token_ids=[1, 2], sampling_params=params))
        doomed = subprocess.Popen([sys.executable, "-c", _DOOMED_CLIENT, address], stdout=subprocess.PIPE, text=True)
        assert doomed.stdout.readline().strip() == "sent"
        held = lambda: (lambda stats: stats.num_running + stats.num_waiting)(survivor.get_stats())  # noqa: E731
        deadline = time.monotonic() + 30
        while held() < 21:
            assert time.monotonic() < deadline, "the doomed client's requests never arrived"
            time.sleep(0.05)
        doomed.kill()
        killed_at = time.monotonic()
        doomed.wait()
        while held() > 1:
            assert time.monotonic() - killed_at < 2.0, "the killed client's requests still run"
            time.sleep(0.05)
        assert survivor.get_stats().num_running == 1  # the living client's request runs on
    finally:
        survivor.shutdown()
        engine.shutdown()
