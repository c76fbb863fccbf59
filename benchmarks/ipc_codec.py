"""IPC codec cost: encode + decode of one engine step's messages for 256 running requests (issue 3: <= 1 ms)."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ipc import (  # noqa: E402
    AbortRequests,
    Decoder,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Encoder,
    SamplingParams,
)

TARGET_US = 1000.0
VOCAB = 8192  # the benchmark model's (the model maker's random ~30M llama)


def step_outputs(rng: random.Random, num_requests: int, logprobs: int | None) -> EngineCoreOutputs:
    """One decode step: one new token per running request, with the top `logprobs` alternatives if set."""
    outputs = []
    for i in range(num_requests):
        token = rng.randrange(VOCAB)
        extra: dict[str, Any] = {} if logprobs is None else {
            "new_logprob_token_ids": [[token, *(rng.randrange(VOCAB) for _ in range(logprobs))]],
            "new_logprobs": [[-10 * rng.random() for _ in range(logprobs + 1)]], "new_sampled_ranks": [1]}
        outputs.append(EngineCoreOutput(request_id=str(i), new_token_ids=[token], **extra))
    return EngineCoreOutputs(outputs=outputs, timestamp=time.time())


def step_inputs(rng: random.Random, num_new: int, prompt_len: int, num_aborts: int) -> list[Any]:
    """One step's client messages: an add for each new request, then one abort."""
    adds = [EngineCoreRequest(request_id=f"new-{i}", prompt_token_ids=[rng.randrange(VOCAB) for _ in range(prompt_len)],
                              sampling_params=SamplingParams(), eos_token_id=0, arrival_time=time.time())
            for i in range(num_new)]
    return [*adds, AbortRequests([str(i) for i in range(num_aborts)])]


def time_round_trips(messages: list[tuple[Any, Decoder]], iterations: int) -> dict[str, float]:
    """Median and p99 microseconds to encode, then decode, every message; and the encoded size."""
    encoder = Encoder()
    for message, decoder in messages:  # a round trip must give back what went in
        assert decoder.decode(encoder.encode(message)) == message
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        for message, decoder in messages:
            decoder.decode(encoder.encode(message))
        samples.append((time.perf_counter() - start) * 1e6)
    size = sum(len(frame) for message, _ in messages for frame in encoder.encode(message))
    return {"median_us": statistics.median(samples), "p99_us": statistics.quantiles(samples, n=100)[98],
            "bytes": size}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=256, help="running requests (one output each)")
    parser.add_argument("--logprobs", type=int, default=5, help="top logprobs in the logprobs variant")
    parser.add_argument("--new-requests", type=int, default=8, help="requests added in the step")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--aborts", type=int, default=4, help="request ids in the step's abort message")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    outputs_decoder, inputs_decoder = Decoder(EngineCoreOutputs), Decoder(EngineCoreInput)
    outputs = [(step_outputs(rng, args.num_requests, None), outputs_decoder)]
    inputs = [(m, inputs_decoder) for m in step_inputs(rng, args.new_requests, args.prompt_len, args.aborts)]
    running = f"{args.num_requests} requests"
    cases = {
        "outputs": (f"one step's outputs ({running})", outputs),
        "outputs_logprobs": (f"one step's outputs ({running}, logprobs={args.logprobs})",
                             [(step_outputs(rng, args.num_requests, args.logprobs), outputs_decoder)]),
        "inputs": (f"one step's inputs ({args.new_requests} adds of {args.prompt_len}-token prompts, 1 abort of "
                   f"{args.aborts} ids)", inputs),
        "step": (f"one step's outputs and inputs ({running})", outputs + inputs),
    }
    results: dict[str, Any] = {"iterations": args.iterations, "target_us": TARGET_US}
    for name, (label, messages) in cases.items():
        timing = results[name] = time_round_trips(messages, args.iterations)
        print(f"encode+decode of {label}: {timing['median_us']:.0f} us median, {timing['p99_us']:.0f} us p99, "
              f"{timing['bytes']} bytes (target <= {TARGET_US:.0f} us)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
