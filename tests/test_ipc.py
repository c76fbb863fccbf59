"""ipc: every message survives the wire; tensors travel as raw frames; nothing falls back to pickle."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from ipc import (
    AbortRequests,
    Decoder,
    Encoder,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    FinishReason,
    RequestError,
    SamplingParams,
    SchedulerOutput,
    UtilityCall,
    UtilityResult,
)

INPUTS = [
    EngineCoreRequest(request_id="a", prompt_token_ids=[1, 2, 3], eos_token_id=0, priority=2, arrival_time=1.5,
                      sampling_params=SamplingParams(temperature=0.7, top_p=0.9, stop=["x"], seed=4, logprobs=2)),
    AbortRequests(request_ids=["a", "b"]),
    UtilityCall(call_id=7, method="get_stats", args=[1, "x"]),
]


@pytest.mark.parametrize("message", INPUTS, ids=lambda m: type(m).__name__)
def test_client_messages_round_trip_as_one_union(message):
    frames = Encoder().encode(message)
    assert Decoder(EngineCoreInput).decode(frames) == message


def test_engine_outputs_round_trip():
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput(request_id="a", new_token_ids=[5], finish_reason=FinishReason.STOP,
                                  stop_reason="x", new_logprob_token_ids=[[5, 6]], new_logprobs=[[-0.1, -2.0]],
                                  new_sampled_ranks=[1], num_cached_tokens=16)],
        errors=[RequestError(request_id="b", message="prompt is empty")],
        utility_result=UtilityResult(call_id=7, result={"num_running": 1}),
        engine_dead=EngineDead(reason="worker died"), timestamp=3.25)
    assert Decoder(EngineCoreOutputs).decode(Encoder().encode(outputs)) == outputs


def test_scheduler_output_round_trips():
    from ipc import CachedRequestData, NewRequestData

    message = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(req_id="a", prompt_token_ids=[1], sampling_params=SamplingParams(),
                                           eos_token_id=None, block_ids=[3, 4], num_computed_tokens=0)],
        scheduled_cached_reqs=[CachedRequestData(req_id="b", new_token_ids=[9], new_block_ids=[],
                                                 num_computed_tokens=12, resumed_from_preemption=True)],
        num_scheduled_tokens={"a": 1, "b": 1}, total_num_scheduled_tokens=2, finished_req_ids=["c"])
    assert Decoder(SchedulerOutput).decode(Encoder().encode(message)) == message


@pytest.mark.parametrize("tensor", [
    torch.arange(12, dtype=torch.float32).view(3, 4), torch.randn(2, 3).bfloat16(), torch.tensor(2.5),
    torch.zeros(0, 4, dtype=torch.int64), torch.arange(10, dtype=torch.int32)[::2], torch.tensor([True, False]),
])
def test_tensors_travel_as_raw_frames(tensor):
    frames = Encoder().encode({"x": tensor, "n": 1})
    assert len(frames) == 2 and len(frames[1]) == tensor.numel() * tensor.element_size()
    decoded = Decoder().decode(frames)
    assert decoded["n"] == 1 and decoded["x"].dtype == tensor.dtype and torch.equal(decoded["x"], tensor)


def test_contiguous_tensors_are_sent_without_a_copy():
    tensor = torch.zeros(1024)
    frames = Encoder().encode([tensor])
    tensor[0] = 1.0
    assert np.frombuffer(frames[1], dtype=np.float32)[0] == 1.0  # the frame is the tensor's own memory


def test_numpy_arrays_round_trip():
    array = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    decoded = Decoder().decode(Encoder().encode({"a": array}))["a"]
    assert decoded.dtype == array.dtype and np.array_equal(decoded, array)


@pytest.mark.parametrize("value", [object(), lambda: 1, np.array([object()])])
def test_nothing_falls_back_to_pickle(value):
    with pytest.raises(TypeError):
        Encoder().encode({"x": value})


@pytest.mark.parametrize("frames, error", [
    ([], msgspec.DecodeError),
    ([b"\xc1"], msgspec.DecodeError),
    ([msgspec.msgpack.encode({"type": "launch_missiles"})], msgspec.ValidationError),
    ([msgspec.msgpack.encode({"type": "abort", "request_ids": "a"})], msgspec.ValidationError),
    ([msgspec.msgpack.encode({"type": "add", "request_id": "a", "prompt_token_ids": [1],
                              "sampling_params": {"top_p": 7}})], msgspec.ValidationError),
])
def test_malformed_messages_raise_decode_errors(frames, error):
    with pytest.raises(error):
        Decoder(EngineCoreInput).decode(frames)


def test_a_tensor_pointing_past_the_frames_is_rejected():
    frames = Encoder().encode({"x": torch.ones(3)})
    with pytest.raises(msgspec.DecodeError, match="frame"):
        Decoder().decode(frames[:1])
