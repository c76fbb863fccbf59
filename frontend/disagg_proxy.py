"""Disaggregated prefill's proxy, inside a data-parallel client of a kv_transfer_config group (engine 0 prefills,
engine 1 decodes): a new request goes first to the prefill engine as a one-token request that hands its prompt's KV
over, then, with where the KV went, to the decode engine, whose outputs alone reach the client."""
from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from frontend.core_client import EngineDeadError
from ipc import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineInfo, FinishReason, RequestError

if TYPE_CHECKING:
    from frontend.data_parallel import DataParallelClient

PREFILL, DECODE = 0, 1


def is_disaggregated(infos: list[EngineInfo]) -> bool:
    return [info.kv_role for info in infos] == ["kv_producer", "kv_consumer"]


class DisaggProxy:
    def __init__(self, group: DataParallelClient) -> None:
        self.group = group
        self.prefilling: dict[str, EngineCoreRequest] = {}  # request id → the client's request, while it prefills
        self.aborted: set[str] = set()  # of those, the ones the client aborted meanwhile

    def carries(self, request: EngineCoreRequest) -> bool:
        """Generation from token ids whose prompt has a whole block before its last token; pooling, prompt embeds,
        images and prompt logprobs (every prompt position computed) go straight to the decode engine."""
        return request.pooling_params is None and request.prompt_embeds is None and not request.mm_inputs and \
            request.sampling_params.prompt_logprobs is None and \
            len(request.prompt_token_ids) - 1 >= self.group.info.block_size

    def add_request(self, request: EngineCoreRequest) -> None:
        group = self.group
        if group.dead_reason is not None:
            raise EngineDeadError(group.dead_reason)
        if group.balancer.alive[PREFILL] and self.carries(request):
            params = msgspec.structs.replace(request.sampling_params, max_tokens=1, min_tokens=0, stop=None, n=1,
                                             logprobs=None, structured_outputs=None)
            group.balancer.assign(request.request_id, PREFILL)
            self.prefilling[request.request_id] = request
            try:
                group.clients[PREFILL].add_request(msgspec.structs.replace(request, sampling_params=params,
                                                                           produce_kv=True))
                return
            except EngineDeadError:
                group.balancer.finished(request.request_id)
                del self.prefilling[request.request_id]
                group._engine_died(PREFILL)
        group.balancer.assign(request.request_id, DECODE)
        try:
            group.clients[DECODE].add_request(request)
        except EngineDeadError:
            group.balancer.finished(request.request_id)
            raise

    def abort(self, request_ids: list[str]) -> None:
        """Aborted while prefilling: the prefill engine's final output becomes the client's ABORT."""
        self.aborted.update(request_id for request_id in request_ids if request_id in self.prefilling)

    def filter(self, batch: EngineCoreOutputs) -> EngineCoreOutputs:
        """The batch less the prefill engine's outputs, each of whose requests goes on to the decode engine (an
        aborted one ends with ABORT, a refused or failed one with its error)."""
        if not self.prefilling:
            return batch
        outputs, errors = [], []
        for error in batch.errors:
            if self.prefilling.pop(error.request_id, None) is not None:
                self.aborted.discard(error.request_id)
            errors.append(error)
        for output in batch.outputs:
            request = self.prefilling.pop(output.request_id, None)
            if request is None:
                outputs.append(output)
                continue
            self.group.balancer.finished(output.request_id)
            if output.request_id in self.aborted or output.finish_reason == FinishReason.ABORT:
                self.aborted.discard(output.request_id)
                outputs.append(_aborted(output.request_id))
            elif (error := self._decode(msgspec.structs.replace(
                    request, kv_transfer_params=output.kv_transfer_params))) is not None:
                errors.append(error)
        return msgspec.structs.replace(batch, outputs=outputs, errors=errors)

    def prefill_engine_died(self) -> EngineCoreOutputs:
        """Its requests go on to the decode engine without KV (computing their prompts there), aborted ones end."""
        outputs, errors = [], []
        for request_id, request in self.prefilling.items():
            if request_id in self.aborted:
                outputs.append(_aborted(request_id))
            elif (error := self._decode(request)) is not None:
                errors.append(error)
        self.prefilling.clear()
        self.aborted.clear()
        return EngineCoreOutputs(outputs=outputs, errors=errors)

    def _decode(self, request: EngineCoreRequest) -> RequestError | None:
        group = self.group
        if group.balancer.alive[DECODE]:
            group.balancer.assign(request.request_id, DECODE)
            try:
                group.clients[DECODE].add_request(request)
                return None
            except EngineDeadError:
                group.balancer.finished(request.request_id)
        return RequestError(request.request_id, f"the decode engine ({DECODE}) of the disaggregated group is gone: "
                            f"{group.clients[DECODE].dead_reason}", "failed")


def _aborted(request_id: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ABORT)
