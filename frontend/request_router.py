"""RequestRouter: the front end's requests in flight — sends each group's engine requests, routes engine outputs
and errors to their groups, and aborts in the engine whatever no group wants any more."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec
from transformers import PreTrainedTokenizerBase

from frontend.core_client import request_error
from frontend.generation_config import with_stop_token_ids
from frontend.multimodal import ImageProcessor
from frontend.output_processor import OutputProcessor
from frontend.prompts import PromptType, check_sampling_params, engine_request, prompt_text
from frontend.request_group import OutputCallback, RequestGroup, child_params
from ipc import (EngineCoreOutput, EngineCoreRequest, EngineInfo, FinishReason, LoRARequest, RequestError,
                 SamplingParams)

# Where a pooling request's result goes: the pooled vector (float32 little-endian bytes) or the error that ends it.
PooledCallback = Callable[[bytes | Exception], None]


class EngineSender(Protocol):
    """What the router needs of an engine-core client."""

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...


class RequestRouter:
    def __init__(self, client: EngineSender, tokenizer: PreTrainedTokenizerBase, info: EngineInfo,
                 model_stop_token_ids: list[int] | None = None, image_processor: ImageProcessor | None = None) -> None:
        self.client, self.tokenizer, self.info = client, tokenizer, info
        self.image_processor = image_processor  # a vision-language model's: prompts' images are processed here
        self.model_stop_token_ids = model_stop_token_ids or []  # the generation config's other EOS ids
        self.output_processor = OutputProcessor(tokenizer)
        self.groups: dict[str, RequestGroup] = {}
        self.children: dict[str, tuple[RequestGroup, int]] = {}  # engine request id → (its group, sample index)
        self.pooling: dict[str, PooledCallback] = {}  # pooling requests in flight

    def add(self, request_id: str, prompt: PromptType, params: SamplingParams, on_output: OutputCallback,
            priority: int = 0, lora_request: LoRARequest | None = None) -> RequestGroup:
        """Validate the request (ValueError naming what is wrong) and send its n engine requests; the group's
        outputs, then its final output or error, go to on_output. release() it once they are no longer wanted."""
        check_sampling_params(params)
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = with_stop_token_ids(params, self.model_stop_token_ids)
        group = RequestGroup(request_id, params, on_output)
        # Tokenized (its images processed) and validated once for all n.
        first = engine_request(self.tokenizer, self.info, group.child_ids[0], prompt, child_params(params, 0),
                               priority, lora_request, self.image_processor)
        requests = [first] + [msgspec.structs.replace(first, request_id=group.child_ids[index],
                                                      sampling_params=child_params(params, index))
                              for index in range(1, params.n)]
        text = prompt_text(prompt)
        try:
            for index, request in enumerate(requests):
                self.client.add_request(request)  # raises EngineDeadError before anything is registered
                # An embeddings prompt's placeholder ids are not its tokens: no ids to report or decode after.
                self.output_processor.add_request(request.request_id, text, [] if request.prompt_embeds is not None
                                                  else request.prompt_token_ids, request.sampling_params)
                self.children[request.request_id] = (group, index)
        except BaseException:
            self._forget(group)
            raise
        self.groups[request_id] = group
        return group

    def add_pooling(self, request: EngineCoreRequest, on_result: PooledCallback) -> None:
        """Send a validated pooling request (frontend.pooling_inputs); its result or error goes to on_result."""
        if request.request_id in self.pooling or request.request_id in self.groups:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.client.add_request(request)
        self.pooling[request.request_id] = on_result

    def release_pooling(self, request_id: str) -> None:
        """Its result is no longer wanted: abort it in the engine if it is still running."""
        if self.pooling.pop(request_id, None) is not None:
            self.client.abort_requests([request_id])

    def has_requests(self) -> bool:
        return bool(self.groups) or bool(self.pooling)

    def route(self, outputs: list[EngineCoreOutput]) -> None:
        """Hand one step's outputs to their groups; abort in the engine the requests a stop string ended here."""
        if self.pooling:
            outputs = [output for output in outputs if not self._pooled(output)]
        results, to_abort = self.output_processor.process_outputs(outputs)
        for result in results:
            entry = self.children.get(result.request_id)
            if entry is None:
                continue
            group, index = entry
            if result.finished:
                del self.children[result.request_id]
            group.child_output(index, result)
            if group.done:
                self._forget(group)
        self.client.abort_requests(to_abort)

    def route_errors(self, errors: list[RequestError]) -> list[RequestError]:
        """End the groups whose engine requests were refused or failed; the errors that are no group's."""
        strays = []
        for error in errors:
            if (on_result := self.pooling.pop(error.request_id, None)) is not None:
                on_result(request_error(error))
                continue
            entry = self.children.get(error.request_id)
            if entry is None:
                strays.append(error)
                continue
            self.children.pop(error.request_id)
            self.output_processor.abort(error.request_id)
            self.fail(entry[0], request_error(error))
        return strays

    def abort(self, request_id: str) -> None:
        """End the request now: each unfinished sample's output so far, finished with finish_reason "abort"."""
        group = self.groups.get(request_id)
        if group is None:
            return
        for index, child_id in enumerate(group.child_ids):
            output = self.output_processor.abort(child_id)
            if output is not None:
                self.children.pop(child_id, None)
                self.client.abort_requests([child_id])
                group.child_output(index, output)
        self._forget(group)

    def fail(self, group: RequestGroup, error: Exception) -> None:
        """End the group with `error`, aborting its samples still running."""
        self._forget(group)
        group.fail(error)

    def fail_all(self, error: Exception) -> None:
        for group in list(self.groups.values()):
            self.fail(group, error)
        pooling, self.pooling = self.pooling, {}
        for on_result in pooling.values():
            on_result(error)

    def _pooled(self, output: EngineCoreOutput) -> bool:
        """Deliver a pooling request's final output; False for any other request's output."""
        on_result = self.pooling.get(output.request_id)
        if on_result is None:
            return False
        if output.finish_reason is not None:
            del self.pooling[output.request_id]
            on_result(output.pooled if output.finish_reason == FinishReason.STOP and output.pooled is not None
                      else RuntimeError(f"pooling request {output.request_id} ended without a result "
                                        f"({output.finish_reason.value})"))
        return True

    def release(self, group: RequestGroup) -> None:
        """Its consumer wants no more outputs: abort whatever of the group is still running, deliver nothing."""
        if self.groups.get(group.request_id) is group:
            self._forget(group)

    def _forget(self, group: RequestGroup) -> None:
        """Drop the group and abort its samples still running."""
        unfinished = []
        for child_id in group.child_ids:
            if self.children.get(child_id, (None,))[0] is group:
                del self.children[child_id]
                self.output_processor.abort(child_id)
                unfinished.append(child_id)
        self.client.abort_requests(unfinished)
        if self.groups.get(group.request_id) is group:
            del self.groups[group.request_id]
