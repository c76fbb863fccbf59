"""What the disaggregated-prefill tests share: their prompts, greedy parameters, a request run alone on one engine of
a group, and whether an engine is stopped."""
from __future__ import annotations

from pathlib import Path

from ipc import EngineCoreRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Shorter than a block (straight to the decode engine), exactly one and two whole blocks, and longer ones.
LENGTHS = [5, 16, 17, 32, 33, 70]
PROMPTS = [[(7 * n + i) % 500 + 1 for i in range(length)] for n, length in enumerate(LENGTHS)]


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": ids} for ids in prompts]


def long_prompt(seed: int) -> list[int]:
    return [(11 * seed + 3 * i) % 700 + 2 for i in range(70)]


def run_alone(client, request: EngineCoreRequest) -> tuple[list[int], object]:
    """The request alone on one engine of the group: (its tokens, its final output)."""
    client.add_request(request)
    tokens = []
    while True:
        for output in client.get_outputs().outputs:
            assert output.request_id == request.request_id and output.error is None
            tokens += output.new_token_ids
            if output.finish_reason is not None:
                return tokens, output


def decode_from_each(decode, ids: list[int], transfers: list[tuple[str, object]]) -> list[list[int]]:
    """The prompt's greedy tokens on the decode engine given each (request id, kv_transfer_params), its prefix cache
    emptied before each: the transfer alone can give it the prompt's blocks."""
    tokens = []
    for request_id, transfer in transfers:
        decode.call_utility("reset_prefix_cache")
        tokens.append(run_alone(decode, EngineCoreRequest(request_id=request_id, prompt_token_ids=ids,
                                                          sampling_params=GREEDY, kv_transfer_params=transfer))[0])
    return tokens


def stopped(pid: int) -> bool:
    """Every thread of the process stopped (SIGSTOP reaches a busy one's threads in their own time)."""
    tasks = Path(f"/proc/{pid}/task")
    return all((task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T" for task in tasks.iterdir())
