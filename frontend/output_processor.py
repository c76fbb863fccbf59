"""Turn engine-core outputs (token ids) into RequestOutputs: detokenize, apply stop strings, track logprobs."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from frontend.detokenizer import IncrementalDetokenizer
from frontend.outputs import CompletionOutput, Logprob, RequestOutput
from ipc import EngineCoreOutput, FinishReason, RequestOutputKind, SamplingParams

_TOKEN_TEXTS = 1 << 18  # the most tokens' texts kept: more than any vocabulary served here


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # How much a DELTA stream has already shown.
    sent_text_len: int = 0
    sent_tokens: int = 0

    def to_output(self, finish_reason: str | None, stop_reason: int | str | None) -> RequestOutput:
        """Everything so far (CUMULATIVE, FINAL_ONLY) or only what is new since the last output (DELTA)."""
        text = self.detokenizer.output_text(finished=finish_reason is not None)
        token_ids, logprobs = self.token_ids, self.logprobs
        if self.params.output_kind == RequestOutputKind.DELTA:
            text, token_ids = text[self.sent_text_len:], token_ids[self.sent_tokens:]
            logprobs = logprobs[self.sent_tokens:] if logprobs is not None else None
            self.sent_text_len += len(text)
            self.sent_tokens += len(token_ids)
        else:
            token_ids, logprobs = list(token_ids), list(logprobs) if logprobs is not None else None
        completion = CompletionOutput(0, text, token_ids, self.cumulative_logprob, logprobs, finish_reason,
                                      stop_reason)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion],
                             finish_reason is not None, self.num_cached_tokens, self.prompt_logprobs)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        # A logprob names its token by the token decoded alone: the same few thousand tokens come back in every
        # entry, and a tokenizer call costs more than the rest of the entry (bounded by the vocabulary).
        self._token_text = functools.lru_cache(maxsize=_TOKEN_TEXTS)(lambda token: tokenizer.decode([token]))

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer, params, prompt_token_ids)
        state = RequestState(request_id, prompt, prompt_token_ids, params, detokenizer)
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        self.states[request_id] = state

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """(RequestOutputs to deliver: final ones, plus per-step ones for streaming output kinds;
        request ids the engine must abort because a stop string ended them here)."""
        results, to_abort = [], []
        for output in outputs:
            state = self.states.get(output.request_id)
            if state is None:
                continue  # finished here already (stop string, abort) while the engine was still running it
            finish_reason, stop_reason = self._process(state, output)
            if finish_reason is not None:
                del self.states[output.request_id]
                if output.finish_reason is None:
                    to_abort.append(output.request_id)
            elif state.params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            results.append(state.to_output(finish_reason, stop_reason))
        return results, to_abort

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.states.pop(request_id, None)
        return state.to_output(FinishReason.ABORT.value, None) if state is not None else None

    def _process(self, state: RequestState, output: EngineCoreOutput) -> tuple[str | None, int | str | None]:
        """Take in the new tokens; (finish_reason, stop_reason) if the request ended, else (None, None)."""
        state.num_cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs is not None:
            lp = output.prompt_logprobs
            state.prompt_logprobs = [None] + [self._logprob_entry(*entry) for entry in zip(lp.token_ids, lp.logprobs,
                                                                                          lp.ranks)]
        last = len(output.new_token_ids) - 1
        hide_last = output.finish_reason is FinishReason.STOP and not state.params.include_stop_str_in_output
        for i, token_id in enumerate(output.new_token_ids):
            state.token_ids.append(token_id)
            if state.logprobs is not None:
                self._add_logprobs(state, output, i)
            if i == last and hide_last:
                continue  # the EOS / stop token's own text is not part of the output
            stop = state.detokenizer.add_token(token_id)
            if stop is not None:
                return FinishReason.STOP.value, stop
        if output.finish_reason is None:
            return None, None
        return output.finish_reason.value, output.stop_reason

    def _add_logprobs(self, state: RequestState, output: EngineCoreOutput, i: int) -> None:
        if output.new_logprobs is None:
            return
        values = output.new_logprobs[i]
        state.logprobs.append(self._logprob_entry(output.new_logprob_token_ids[i], values, output.new_sampled_ranks[i]))
        state.cumulative_logprob += values[0]

    def _logprob_entry(self, ids: list[int], values: list[float], rank: int) -> dict[int, Logprob]:
        """{token id: Logprob} for [chosen, top-k ...]; the chosen token keeps its own rank."""
        entry = {tid: Logprob(lp, top_rank, self._token_text(tid))
                 for top_rank, (tid, lp) in enumerate(zip(ids[1:], values[1:]), start=1)}
        entry[ids[0]] = Logprob(values[0], rank, self._token_text(ids[0]))
        return entry
