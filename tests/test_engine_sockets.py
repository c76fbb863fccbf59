"""The engine core's sockets: several clients, malformed frames, CURVE, loopback by default, no pickle."""
from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
import textwrap
import uuid

import msgspec
import pytest
import zmq
import zmq.auth

from conftest import random_prompts
from core.engine_spawn import EngineProcess
from frontend import LLM, EngineCoreClient, SamplingParams
from ipc import Decoder, EngineConfig, EngineCoreOutputs, EngineCoreRequest, UtilityCall
from ipc.sockets import EngineEndpoints, check_binding_is_safe, connect_dealer, free_tcp_address, private_ipc_address

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_address(llama_model):
    address = private_ipc_address()
    engine = EngineProcess(EngineConfig(model=llama_model, dtype="float32"), address)
    engine.wait_ready()
    yield address
    assert engine.is_alive(), "the engine core died during the tests"
    engine.shutdown()


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


_HELLO = 1000  # call ids of handshake calls, told apart from the test's own


def _handshake(sock_in: zmq.Socket, sock_out: zmq.Socket) -> None:
    """Say hello until the engine answers, as the client library does: the engine's ROUTER drops replies to a
    client whose output connection is not up yet. The answers are left for _replies to skip."""
    for attempt in range(30):
        sock_in.send(msgspec.msgpack.encode(UtilityCall(call_id=_HELLO + attempt, method="get_info")))
        if sock_out.poll(1000):
            return
    raise AssertionError("the engine never answered the handshake")


def _replies(output: zmq.Socket, count: int) -> list[EngineCoreOutputs]:
    decoder = Decoder(EngineCoreOutputs)
    replies = []
    while len(replies) < count:
        assert output.poll(10_000), "the engine did not answer"
        reply = decoder.decode(output.recv_multipart())
        if reply.utility_result is None or reply.utility_result.call_id < _HELLO:  # not a (late) handshake answer
            replies.append(reply)
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
        assert [r.utility_result.call_id for r in replies if r.utility_result] == [9]
        good = EngineCoreRequest(request_id="good", prompt_token_ids=[3, 4, 5], sampling_params=GREEDY)
        sock_in.send(msgspec.msgpack.encode(good))
        outputs = []
        while not outputs or outputs[-1].finish_reason is None:
            outputs.extend(_replies(sock_out, 1)[0].outputs)
        assert sum(len(o.new_token_ids) for o in outputs) == 10
    finally:
        context.destroy(linger=0)


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
    guard: dict = {}
    exec(_PICKLE_GUARD, guard)  # the same guard in this (front-end) process
    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, getattr(guard["pickle"], name))
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
