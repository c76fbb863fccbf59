"""LLM: offline batched generation and chat over the engine (vLLM's interface)."""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import msgspec
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from frontend.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, live_beams, take_step
from frontend.connect import connect_engine
from frontend.generation_config import load_generation_defaults, model_stop_token_ids
from frontend.multimodal import ImageProcessor, chat_image_parts
from frontend.outputs import (ClassificationOutput, EmbeddingOutput, PoolingRequestOutput, RequestOutput,
                              ScoringOutput)
from frontend.pooling_inputs import PoolingInput, as_inputs, input_token_ids, pooling_request, score_pairs
from frontend.pooling_results import cosine, probabilities, vector
from frontend.prompts import PromptType, check_sampling_params, tokenize_prompt
from frontend.request_group import FinalOutputs
from frontend.request_router import RequestRouter
from frontend.tokenizer import apply_chat_template, load_tokenizer, model_folder, tokenizer_folder
from ipc import LoRARequest, PoolingParams, RequestOutputKind, SamplingParams, SchedulerStats

# vLLM's `task` names → the runner that serves them.
_TASK_RUNNERS = {"generate": "generate", "embed": "pooling", "embedding": "pooling", "classify": "pooling",
                 "score": "pooling"}


class LLM:
    """`LLM(model=folder, dtype=..., max_model_len=..., ...)`; engine keyword names as in vLLM."""

    def __init__(self, model: str | None = None, *, in_process: bool = False, engine_address: str | None = None,
                 curve_key_file: str | None = None, generation_config: str = "auto", **engine_args) -> None:
        """Starts a private engine-core process, or runs the engine here (`in_process=True`, for debugging),
        or attaches to a running engine core (`engine_address`, with `curve_key_file` if it uses CURVE).
        generate() without sampling params samples as the model's generation_config.json recommends ("auto"), or
        with SamplingParams() ("vllm"), or as a generation_config.json in another folder (vLLM's rule)."""
        if "task" in engine_args:
            task = engine_args.pop("task")
            if task not in _TASK_RUNNERS:
                raise ValueError(f"task must be one of {sorted(_TASK_RUNNERS)}, got {task!r}")
            engine_args.setdefault("runner", _TASK_RUNNERS[task])
        files = tokenizer_folder(model, engine_args.get("tokenizer")) if model else None  # before an engine starts
        self.client = connect_engine(model, engine_args, in_process=in_process, engine_address=engine_address,
                                     curve_key_file=curve_key_file)
        self._shutdown = weakref.finalize(self, self.client.shutdown)
        self.info = self.client.info
        self.tokenizer = load_tokenizer(files or self.info.model)
        model_files = model_folder(model or self.info.model, files)  # generation_config.json
        self.router = RequestRouter(self.client, self.tokenizer, self.info,
                                    model_stop_token_ids(model_files, self.tokenizer.eos_token_id),
                                    ImageProcessor.of(model_files, self.info))
        self.default_sampling_params = SamplingParams(**load_generation_defaults(model_files,
                                                                                  generation_config))
        self._request_counter = itertools.count()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Outputs in input order. Prompts: text, {"prompt": text}, {"prompt_token_ids": [...]} or (with
        enable_prompt_embeds=True) {"prompt_embeds": [seq_len, hidden_size] tensor}, optionally with "cache_salt".
        With n > 1 each output holds n samples (n engine requests sharing prompt blocks).
        lora_request: one adapter for every prompt, or one (or None: the base model) per prompt."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = _per_prompt(sampling_params or self.default_sampling_params, len(prompts), "sampling_params")
        priorities = _per_prompt(priority, len(prompts), "priority") if priority is not None else [0] * len(prompts)
        adapters = [lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, LoRARequest) \
            else _per_prompt(lora_request, len(prompts), "lora_request")
        finals = FinalOutputs(len(prompts))
        groups = []
        try:
            for position, (prompt, sp, prio, lora) in enumerate(zip(prompts, params, priorities, adapters)):
                # Only final outputs are needed here: skip building per-step ones.
                sp = msgspec.structs.replace(check_sampling_params(sp), output_kind=RequestOutputKind.FINAL_ONLY)
                groups.append(self.router.add(str(next(self._request_counter)), prompt, sp, finals.callback(position),
                                              prio, lora))
            self._run(finals, use_tqdm)
        finally:  # an error, or Ctrl-C: nothing may stay running in the engine
            for group in groups:
                self.router.release(group)
        return finals.outputs

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; rendered with `chat_template` (a template's text) or
        the tokenizer's own. A vision-language model's messages may hold image parts: {"type": "image_pil",
        "image_pil": PIL.Image} or {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conversation in conversations:
            conversation, images = chat_image_parts(conversation)
            text = apply_chat_template(self.tokenizer, conversation, self.info.model, add_generation_prompt,
                                       chat_template)
            if images:  # the text is expanded and tokenized with its images
                prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
                continue
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
        while (step := live_beams(searches))[0]:
            live, beams = step
            take_step(live, iter(self.generate([{"prompt_token_ids": ids} for ids in beams],
                                               params.step_sampling_params(), use_tqdm=False)))
        return [search.output(self.tokenizer) for search in searches]

    def embed(self, prompts: PoolingInput | Sequence[PoolingInput], *, truncate_prompt_tokens: int | None = None,
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Embeddings in input order (`.outputs.embedding`). truncate_prompt_tokens: keep each input's first k
        tokens (-1: the model's limit); without it an input over the limit is an error."""
        params = pooling_params or PoolingParams()
        if not isinstance(params, PoolingParams) or params.task != "embed":
            raise ValueError("pooling_params must be PoolingParams with task 'embed'")
        ids, _ = input_token_ids(self.tokenizer, self.info, as_inputs(prompts), truncate_prompt_tokens)
        return [PoolingRequestOutput(str(i), token_ids, EmbeddingOutput(vector(pooled).tolist()))
                for i, (token_ids, pooled) in enumerate(zip(ids, self._pool(ids, params, use_tqdm)))]

    def classify(self, prompts: PoolingInput | Sequence[PoolingInput], *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """A sequence classifier's class probabilities in input order (`.outputs.probs`)."""
        ids, _ = input_token_ids(self.tokenizer, self.info, as_inputs(prompts), truncate_prompt_tokens)
        return [PoolingRequestOutput(str(i), token_ids, ClassificationOutput(probabilities(pooled)))
                for i, (token_ids, pooled) in enumerate(zip(ids, self._pool(ids, PoolingParams(task="classify"),
                                                                                 use_tqdm)))]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """The score of each pair (text_1 against every text_2, or pair by pair for two lists of one length):
        a cross-encoder's sigmoid-activated logit, or the cosine of a bi-encoder's embeddings."""
        firsts, seconds = score_pairs(text_1, text_2)
        pooling = self.info.pooling
        if pooling is not None and pooling.num_labels:
            if pooling.num_labels != 1:
                raise ValueError(f"score needs a cross-encoder with one label; this classifier has "
                                 f"{pooling.num_labels}: use classify")
            ids, types = input_token_ids(self.tokenizer, self.info, firsts, truncate_prompt_tokens, pairs=seconds)
            pooled = self._pool(ids, PoolingParams(task="classify"), use_tqdm, types)
            return [PoolingRequestOutput(str(i), token_ids, ScoringOutput(probabilities(logit)[0]))
                    for i, (token_ids, logit) in enumerate(zip(ids, pooled))]
        texts = list(dict.fromkeys([*firsts, *seconds]))  # each distinct text embedded once
        ids, _ = input_token_ids(self.tokenizer, self.info, texts, truncate_prompt_tokens)
        embedding = dict(zip(texts, self._pool(ids, PoolingParams(), use_tqdm)))
        token_ids = dict(zip(texts, ids))
        return [PoolingRequestOutput(str(i), token_ids[a] + token_ids[b], ScoringOutput(cosine(embedding[a],
                                                                                                embedding[b])))
                for i, (a, b) in enumerate(zip(firsts, seconds))]

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def get_stats(self) -> SchedulerStats:
        return self.client.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (e.g. before timing a cold run)."""
        return self.client.call_utility("reset_prefix_cache")

    def start_profile(self) -> str:
        """Start the engine's torch profiler (needs $PAGEDSERVE_TORCH_PROFILER_DIR or LLM(..., profiler_dir=DIR));
        returns DIR."""
        return self.client.call_utility("start_profile")

    def stop_profile(self) -> str:
        """Stop the profiler; returns the path of the Chrome trace it wrote."""
        return self.client.call_utility("stop_profile")

    def shutdown(self) -> None:
        """Stop the engine core this LLM started (also done when the LLM is garbage collected or at exit)."""
        self._shutdown()

    def _pool(self, ids: list[list[int]], params: PoolingParams, use_tqdm: bool,
              token_type_ids: list[list[int]] | None = None) -> list[bytes]:
        """Every input validated first, then sent longest first (inputs of like length then share a step, which
        pads an encoder's attention least); the pooled results in input order."""
        requests = [pooling_request(self.info, str(next(self._request_counter)), token_ids, params,
                                    token_type_ids[i] if token_type_ids else None) for i, token_ids in enumerate(ids)]
        finals = FinalOutputs(len(requests))
        try:
            for i in sorted(range(len(requests)), key=lambda i: -len(ids[i])):
                self.router.add_pooling(requests[i], finals.callback(i))
            self._run(finals, use_tqdm)
        finally:
            for request in requests:
                self.router.release_pooling(request.request_id)
        return finals.outputs

    def _run(self, finals: FinalOutputs, use_tqdm: bool) -> None:
        """Pull the engine's outputs until every request has its final output; the first error raises."""
        with tqdm(total=finals.remaining, desc="Processed prompts", disable=not use_tqdm) as bar:
            while not finals.ended:
                batch = self.client.get_outputs()
                self.router.route_errors(batch.errors)
                before = finals.remaining
                self.router.route(batch.outputs)
                bar.update(before - finals.remaining)
        if finals.error is not None:
            raise finals.error


def _per_prompt(value, count: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count

