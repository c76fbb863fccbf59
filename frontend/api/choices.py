"""Run the choices of one OpenAI request (n per prompt) as engine requests and merge their streams, recording
metrics (TTFT, inter-token latency, end-to-end, token counts) as outputs arrive."""
from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from frontend.api.metrics import ServerMetrics
from frontend.async_llm import AsyncLLM
from frontend.outputs import RequestOutput
from frontend.prompts import PromptType
from frontend.stream_merge import merge_streams
from ipc import RequestOutputKind, SamplingParams

@dataclass
class Choice:
    """One engine request behind a choice; its token count grows as the stream goes."""

    prompt: PromptType
    params: SamplingParams
    num_prompt_tokens: int
    num_completion_tokens: int = 0


ChoiceOutput = tuple[int, RequestOutput]  # (choice index, its output)


async def stream_choices(engine: AsyncLLM, choices: list[Choice], request_id: str, metrics: ServerMetrics
                         ) -> AsyncIterator[ChoiceOutput]:
    """(choice index, delta output) as they come; closing the iterator aborts every unfinished choice."""
    # One choice (the common case) needs no merging: no task and queue hop per token, and no generator in between.
    single = len(choices) == 1
    outputs = (engine.generate(choices[0].prompt, choices[0].params, f"{request_id}-0") if single
               else _merged(engine, choices, request_id))
    start, last = time.monotonic(), [None] * len(choices)
    streamed = [choice.params.output_kind == RequestOutputKind.DELTA for choice in choices]  # only streams time tokens
    async with contextlib.aclosing(outputs):
        async for item in outputs:
            index, output = (0, item) if single else item
            now = time.monotonic()
            if streamed[index]:
                metrics.observe_token_times(now - start if last[index] is None else None,
                                            now - last[index] if last[index] is not None else None)
            last[index] = now
            choices[index].num_completion_tokens += len(output.outputs[0].token_ids)
            yield index, output
    metrics.observe_request(sum(c.num_prompt_tokens for c in choices),
                            sum(c.num_completion_tokens for c in choices), time.monotonic() - start)


def _merged(engine: AsyncLLM, choices: list[Choice], request_id: str) -> AsyncIterator[ChoiceOutput]:
    return merge_streams([engine.generate(choice.prompt, choice.params, f"{request_id}-{index}")
                          for index, choice in enumerate(choices)])
