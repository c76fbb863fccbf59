"""Request and its state machine: WAITING → RUNNING ⇄ PREEMPTED(→ WAITING) → FINISHED_*."""
from __future__ import annotations

import enum
import secrets

from typing import TYPE_CHECKING

from ipc import EngineCoreRequest, FinishReason, PromptLogprobs, SamplingParams
from ipc.kv_transfer import KVTransferParams
from ipc.sampling_params import stop_tokens, tokens_left

if TYPE_CHECKING:
    from core.structured_output.backends import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}
_ALLOWED = {
    RequestStatus.WAITING: {RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED},
    RequestStatus.RUNNING: {RequestStatus.PREEMPTED, *_FINISH_REASONS},
    RequestStatus.PREEMPTED: {RequestStatus.WAITING, RequestStatus.FINISHED_ABORTED},
}


class Request:
    """The scheduler's view of one request: its tokens, how many are computed, and its state."""

    def __init__(self, core_request: EngineCoreRequest, arrival_index: int, max_tokens: int) -> None:
        self.request_id = core_request.request_id
        self.prompt_token_ids = core_request.prompt_token_ids
        self.all_token_ids = list(core_request.prompt_token_ids)  # prompt + outputs, what block hashes cover
        self.lora_request = core_request.lora_request
        # Blocks computed under an adapter hold its keys and values: only requests with the same adapter (and salt)
        # may share them.
        self.cache_salt = core_request.cache_salt if self.lora_request is None else \
            f"{core_request.cache_salt or ''}\x00{self.lora_request.cache_key}"
        self.prompt_embeds = core_request.prompt_embeds
        if self.prompt_embeds is not None:
            # Its prompt ids are placeholders, not content: a salt of its own keeps its blocks from every other
            # request (it finds them again itself, recomputing after preemption).
            self.cache_salt = f"{self.cache_salt or ''}\x00embeds:{secrets.token_hex(16)}"
        self.mm_inputs = core_request.mm_inputs  # its images: their hashes key the blocks their placeholders are in
        self.num_encoded_images = 0  # of mm_inputs, those a scheduled chunk reached (core/encoder_budget.py)
        self.block_hashes: list[bytes] = []  # one per full block of all_token_ids, filled in by the KV manager
        self.sampling_params: SamplingParams = core_request.sampling_params
        self.eos_token_id = core_request.eos_token_id
        self.priority = core_request.priority
        self.arrival_index = arrival_index
        self.max_tokens = max_tokens
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache when first scheduled
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Tokens sampled since the workers last saw this request (sent in the next SchedulerOutput).
        self.unsent_token_ids: list[int] = []
        # Speculative decoding: drafts proposed for its next step, and those its step in flight verifies.
        self.spec_token_ids: list[int] = []
        self.scheduled_spec_token_ids: list[int] = []
        # Prompt logprobs computed so far, chunk by chunk, until they go out with the first output.
        self.pending_prompt_logprobs: PromptLogprobs | None = None
        # Its structured-output matcher (core/structured_output), attached once its grammar has compiled.
        self.grammar: RequestGrammar | None = None
        self.grammar_error: str | None = None  # why its matcher failed: it ends with this error
        self.pooling_params = core_request.pooling_params  # a pooling request ends once its prompt is computed
        self.token_type_ids = core_request.token_type_ids
        # Whether cached blocks may stand in for its first tokens: not when each prompt position's output is wanted
        # (prompt logprobs; pooling other than the last token's).
        self.reads_prefix_cache = self.sampling_params.prompt_logprobs is None
        # Disaggregated prefill (core/kv_transfer.py): hand the prompt's KV over when finished (a prefill engine's
        # request), where it went (on its final output), and where to load it from (a decode engine's request).
        self.produce_kv = core_request.produce_kv
        self.kv_sent: KVTransferParams | None = None
        self.kv_transfer_params = core_request.kv_transfer_params

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower runs first; the highest is preempted first (FCFS is priority 0 for everyone)."""
        return self.priority, self.arrival_index

    def set_status(self, status: RequestStatus) -> None:
        if status not in _ALLOWED.get(self.status, set()):
            raise RuntimeError(f"request {self.request_id}: illegal transition {self.status.name} → {status.name}")
        self.status = status

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.unsent_token_ids.append(token_id)

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        if self.pending_prompt_logprobs is None:
            self.pending_prompt_logprobs = chunk
        else:
            self.pending_prompt_logprobs.extend(chunk)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the last sampled token leads to, if any."""
        params, token = self.sampling_params, self.output_token_ids[-1]
        num_out = len(self.output_token_ids)
        if self.grammar is not None and self.grammar.is_terminated:  # the grammar's end wins over min_tokens
            return RequestStatus.FINISHED_STOPPED
        if num_out >= params.min_tokens and token in stop_tokens(params, self.eos_token_id):
            if token != self.eos_token_id or params.ignore_eos:  # a stop token's id is reported; EOS is not
                self.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if tokens_left(self.max_tokens, num_out, max_model_len, self.num_tokens) <= 0:
            return RequestStatus.FINISHED_LENGTH
        return None
