"""LLM: offline batched generation and chat over the engine (vLLM's interface)."""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import msgspec
from tqdm.auto import tqdm

from frontend.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from frontend.connect import connect_engine
from frontend.core_client import request_error
from frontend.output_processor import OutputProcessor
from frontend.outputs import RequestOutput
from frontend.parallel_sampling import child_params, child_request_id, merge_samples
from frontend.prompts import PromptType, engine_request, prompt_text, tokenize_prompt
from frontend.tokenizer import apply_chat_template, load_tokenizer
from ipc import EngineCoreRequest, RequestOutputKind, SamplingParams, SchedulerStats


class LLM:
    """`LLM(model=folder, dtype=..., max_model_len=..., ...)`; engine keyword names as in vLLM."""

    def __init__(self, model: str | None = None, *, in_process: bool = False, engine_address: str | None = None,
                 curve_key_file: str | None = None, **engine_args) -> None:
        """Starts a private engine-core process, or runs the engine here (`in_process=True`, for debugging),
        or attaches to a running engine core (`engine_address`, with `curve_key_file` if it uses CURVE)."""
        self.client = connect_engine(model, engine_args, in_process=in_process, engine_address=engine_address,
                                     curve_key_file=curve_key_file)
        self._shutdown = weakref.finalize(self, self.client.shutdown)
        self.info = self.client.info
        self.tokenizer = load_tokenizer(model or self.info.model)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Outputs in input order. Prompts: text, {"prompt": text} or {"prompt_token_ids": [...]}, optionally
        with "cache_salt". With n > 1 each output holds n samples (n engine requests sharing prompt blocks)."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        priorities = _per_prompt(priority, len(prompts), "priority") if priority is not None else [0] * len(prompts)
        families = [self._make_requests(p, sp, prio) for p, sp, prio in zip(prompts, params, priorities)]
        for (_, requests), prompt in zip(families, prompts):
            for request in requests:
                self.output_processor.add_request(request.request_id, prompt_text(prompt), request.prompt_token_ids,
                                                  request.sampling_params)
                self.client.add_request(request)
        results = self._run([r.request_id for _, requests in families for r in requests], use_tqdm)
        return [merge_samples(parent_id, [results[r.request_id] for r in requests]) if len(requests) > 1
                else results[requests[0].request_id] for parent_id, requests in families]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; rendered with the tokenizer's chat template."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conversation in conversations:
            text = apply_chat_template(self.tokenizer, conversation, self.info.model, add_generation_prompt)
            # The template already wrote its special tokens; do not let the tokenizer add a second BOS.
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
                    ) -> list[BeamSearchOutput]:
        """Beam search as transformers' `generate(num_beams=...)` does it; one output per prompt, best beam first.
        Each step runs every live beam of every prompt as one batch of one-token requests."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        searches = [BeamSearch(tokenize_prompt(self.tokenizer, prompt), params, self.tokenizer.eos_token_id, self.info)
                    for prompt in prompts]
        while live := [search for search in searches if not search.done]:
            beams = [{"prompt_token_ids": ids} for search in live for ids in search.beam_prompts()]
            outputs = iter(self.generate(beams, params.step_sampling_params(), use_tqdm=False))
            for search in live:
                search.step([next(outputs).outputs[0].logprobs[0] for _ in search.running])
        return [search.output(self.tokenizer) for search in searches]

    def get_stats(self) -> SchedulerStats:
        return self.client.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (e.g. before timing a cold run)."""
        return self.client.call_utility("reset_prefix_cache")

    def start_profile(self) -> str:
        """Start the engine's torch profiler (needs LLM(..., profiler_dir=DIR)); returns DIR."""
        return self.client.call_utility("start_profile")

    def stop_profile(self) -> str:
        """Stop the profiler; returns the path of the Chrome trace it wrote."""
        return self.client.call_utility("stop_profile")

    def shutdown(self) -> None:
        """Stop the engine core this LLM started (also done when the LLM is garbage collected or at exit)."""
        self._shutdown()

    def _make_requests(self, prompt: PromptType, params: SamplingParams, priority: int
                       ) -> tuple[str, list[EngineCoreRequest]]:
        """The prompt's request id and its engine requests (one, or one per sample when n > 1)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        # Only final outputs are needed here: skip building per-step ones.
        params = msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        parent_id = str(next(self._request_counter))
        if params.n == 1:
            return parent_id, [engine_request(self.tokenizer, self.info, parent_id, prompt, params, priority)]
        return parent_id, [engine_request(self.tokenizer, self.info, child_request_id(parent_id, index), prompt,
                                          child_params(params, index), priority) for index in range(params.n)]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        results: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
                while self.output_processor.has_unfinished_requests():
                    batch = self.client.get_outputs()
                    if batch.errors:
                        raise request_error(batch.errors[0])
                    finished, to_abort = self.output_processor.process_outputs(batch.outputs)
                    self.client.abort_requests(to_abort)
                    for output in finished:
                        results[output.request_id] = output
                    bar.update(len(finished))
        finally:
            unfinished = [r for r in request_ids if r not in results]
            self.client.abort_requests(unfinished)
            for request_id in unfinished:
                self.output_processor.abort(request_id)
        return results


def _per_prompt(value, count: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count
