"""LLM: offline batched generation and chat over the engine (vLLM's interface)."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from core import EngineCore
from frontend.output_processor import OutputProcessor
from frontend.outputs import RequestOutput
from frontend.tokenizer import apply_chat_template, load_tokenizer
from ipc import EngineConfig, EngineCoreRequest, SamplingParams

PromptType = str | dict


class LLM:
    """`LLM(model=folder, dtype=..., max_model_len=..., ...)`; keyword names as in vLLM."""

    def __init__(self, model: str, **engine_args) -> None:
        unknown = set(engine_args) - set(EngineConfig.__struct_fields__)
        if unknown:
            raise ValueError(f"unknown LLM arguments {sorted(unknown)}; "
                             f"known: {sorted(set(EngineConfig.__struct_fields__) - {'model'})}")
        self.config = EngineConfig(model=str(model), **engine_args)
        self.engine_core = EngineCore(self.config)
        self.tokenizer = load_tokenizer(self.config.model)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Outputs in input order. Prompts: text, {"prompt": text} or {"prompt_token_ids": [...]}."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        priorities = _per_prompt(priority, len(prompts), "priority") if priority is not None else [0] * len(prompts)
        requests = [self._make_request(p, sp, prio) for p, sp, prio in zip(prompts, params, priorities)]
        for request, prompt in zip(requests, prompts):
            self.output_processor.add_request(request.request_id, _prompt_text(prompt), request.prompt_token_ids,
                                              request.sampling_params)
            self.engine_core.add_request(request)
        return self._run([r.request_id for r in requests], use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; rendered with the tokenizer's chat template."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conversation in conversations:
            text = apply_chat_template(self.tokenizer, conversation, self.config.model, add_generation_prompt)
            # The template already wrote its special tokens; do not let the tokenizer add a second BOS.
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_stats(self) -> dict[str, float]:
        return self.engine_core.scheduler.stats()

    def _make_request(self, prompt: PromptType, params: SamplingParams, priority: int) -> EngineCoreRequest:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        request = EngineCoreRequest(request_id=str(next(self._request_counter)),
                                    prompt_token_ids=self._tokenize(prompt), sampling_params=params,
                                    eos_token_id=self.tokenizer.eos_token_id, priority=int(priority))
        self.engine_core.validate_request(request)
        return request

    def _tokenize(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of ints")
            return ids
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a str, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
                             f"got {type(prompt).__name__}")
        if not text:
            raise ValueError("prompt is empty")
        return self.tokenizer.encode(text)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
                while self.output_processor.has_unfinished_requests():
                    if not self.engine_core.has_unfinished_requests():
                        raise RuntimeError("the engine finished requests without reporting them (a bug)")
                    finished, to_abort = self.output_processor.process_outputs(self.engine_core.step())
                    self.engine_core.abort_requests(to_abort)
                    for output in finished:
                        results[output.request_id] = output
                    bar.update(len(finished))
        finally:
            unfinished = [r for r in request_ids if r not in results]
            self.engine_core.abort_requests(unfinished)
            for request_id in unfinished:
                self.output_processor.abort(request_id)
        return [results[r] for r in request_ids]


def _per_prompt(value, count: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count


def _prompt_text(prompt: PromptType) -> str | None:
    return prompt if isinstance(prompt, str) else prompt.get("prompt")
