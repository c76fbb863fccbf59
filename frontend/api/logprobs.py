"""OpenAI logprobs bodies from CompletionOutput logprobs: the completions (legacy) and chat formats."""
from __future__ import annotations

from frontend.outputs import CompletionOutput, Logprob


def completion_logprobs(completion: CompletionOutput, num_top: int, text_offset: int) -> dict | None:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}; offsets count from text_offset."""
    if completion.logprobs is None:
        return None
    return _completions_body(completion.token_ids, completion.logprobs, num_top, text_offset)


def prompt_logprobs(prompt_token_ids: list[int], entries: list[dict[int, Logprob] | None], first_token: str,
                    num_top: int) -> dict:
    """An echoed prompt's logprobs in the completions format: nothing predicts its first token (None)."""
    first = {"tokens": [first_token], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    return join_logprobs(first, _completions_body(prompt_token_ids[1:], entries[1:], num_top, len(first_token)))


def _completions_body(token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int,
                      text_offset: int) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        tokens.append(chosen.decoded_token)
        values.append(chosen.logprob)
        tops.append({lp.decoded_token: lp.logprob for _, lp in _top(entry, num_top)})
        offsets.append(text_offset)
        text_offset += len(chosen.decoded_token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_body(entries: list[dict[int, Logprob] | None] | None) -> list[dict[str, dict] | None] | None:
    """vLLM's prompt_logprobs: per prompt token None (the first: nothing predicts it) or {token id: {"logprob",
    "rank", "decoded_token"}} of the token and its best alternatives."""
    if entries is None:
        return None
    return [None if entry is None else {str(token): {"logprob": lp.logprob, "rank": lp.rank,
                                                     "decoded_token": lp.decoded_token} for token, lp in entry.items()}
            for entry in entries]


def join_logprobs(first: dict | None, second: dict | None) -> dict | None:
    """Two completions-format logprobs bodies as one (the echoed prompt's, then the completion's)."""
    if first is None or second is None:
        return second if first is None else first
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(completion: CompletionOutput, num_top: int) -> dict | None:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}."""
    if completion.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        content.append({**_chat_token(entry[token_id]),
                        "top_logprobs": [_chat_token(lp) for _, lp in _top(entry, num_top)]})
    return {"content": content}


def _top(entry: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The entry's top-k alternatives, best first (the chosen token is among them only if it ranks in the top k)."""
    return sorted(((tid, lp) for tid, lp in entry.items() if lp.rank <= num_top), key=lambda item: item[1].rank)


def _chat_token(logprob: Logprob) -> dict:
    return {"token": logprob.decoded_token, "logprob": logprob.logprob,
            "bytes": list(logprob.decoded_token.encode("utf-8"))}
