"""OpenAI logprobs bodies from CompletionOutput logprobs: the completions (legacy) and chat formats."""
from __future__ import annotations

from frontend.outputs import CompletionOutput, Logprob


def completion_logprobs(completion: CompletionOutput, num_top: int, text_offset: int) -> dict | None:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}; offsets count from text_offset."""
    if completion.logprobs is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        chosen = entry[token_id]
        tokens.append(chosen.decoded_token)
        values.append(chosen.logprob)
        tops.append({lp.decoded_token: lp.logprob for _, lp in _top(entry, num_top)})
        offsets.append(text_offset)
        text_offset += len(chosen.decoded_token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


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
