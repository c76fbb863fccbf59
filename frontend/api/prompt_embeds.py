"""/v1/completions' prompt_embeds: base64 text of torch.save'd tensors, read by torch's safe loader only and checked
against the engine's rules (vLLM's field, served with --enable-prompt-embeds)."""
from __future__ import annotations

import base64
import binascii
import io
import zipfile

from frontend.api.errors import APIError
from frontend.api.protocol import CompletionRequest
from ipc import EngineInfo, PromptEmbeds
from ipc.request_rules import InvalidRequestError, check_prompt_embeds_enabled

_FIELD = "prompt_embeds"
_SAVE_OVERHEAD_BYTES = 64 << 10  # torch.save's zip records and pickle around the tensor's bytes, with room to spare
_NOT_WITH_EMBEDS = {"echo": "echo has no prompt text to show", "use_beam_search": "beam search extends token prompts"}


def embeds_list(body: CompletionRequest, info: EngineInfo) -> list[str]:
    """The request's embeddings, one base64 text per prompt, once the engine takes them and nothing else in the
    request needs a token prompt (APIError 400 naming the field otherwise)."""
    try:
        check_prompt_embeds_enabled(info)
    except InvalidRequestError as error:
        raise APIError(400, str(error), error.param) from None
    for name, why in _NOT_WITH_EMBEDS.items():
        if getattr(body, name):
            raise APIError(400, f"{name} is not supported with prompt_embeds: {why}", name)
    texts = [body.prompt_embeds] if isinstance(body.prompt_embeds, str) else list(body.prompt_embeds)
    if not texts:
        raise APIError(400, "prompt_embeds is empty", _FIELD)
    return texts


def max_embeds_chars(info: EngineInfo) -> int:
    """The longest base64 text of one prompt's embeddings: max_model_len rows of float32, saved."""
    return 4 * -(-(info.max_model_len * info.hidden_size * 4 + _SAVE_OVERHEAD_BYTES) // 3)


def read_prompt_embeds(info: EngineInfo, text: str) -> dict:
    """One prompt's embeddings as a prompt the engine takes: {"prompt_embeds", "prompt_token_ids": placeholders}.
    torch.load runs with weights_only=True: tensors and plain containers only, no object is ever built from the
    client's pickle."""
    if len(text) > (limit := max_embeds_chars(info)):
        raise APIError(400, f"prompt_embeds is {len(text)} characters of base64, over this model's {limit} "
                       f"({info.max_model_len} rows of {info.hidden_size} float32 values)", _FIELD)
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "prompt_embeds is not base64 text", _FIELD) from None
    _check_archive(raw)
    import torch  # only for requests with embeddings: the gateway stays light without them

    try:
        tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception:  # any malformed or refused payload; the loader's own text suggests unsafe loading
        raise APIError(400, "prompt_embeds is not a tensor saved by torch.save, or holds objects other than "
                       "tensors (it is read with torch.load(weights_only=True))", _FIELD) from None
    try:
        embeds = PromptEmbeds.of(tensor)
    except ValueError as error:
        raise APIError(400, str(error), _FIELD) from None
    return {"prompt_embeds": embeds, "prompt_token_ids": [0] * embeds.num_rows}


def _check_archive(raw: bytes) -> None:
    """torch.save's zip archive with its records stored uncompressed, so that what the loader allocates is bounded
    by what the client sent: a compressed record could inflate past the size cap, and the legacy (pre-zip) format
    lets a pickle claim storage sizes before their bytes are read."""
    try:
        entries = zipfile.ZipFile(io.BytesIO(raw)).infolist()
    except (zipfile.BadZipFile, ValueError, OSError):
        raise APIError(400, "prompt_embeds is not a tensor saved by torch.save (its zip format)", _FIELD) from None
    if any(entry.compress_type != zipfile.ZIP_STORED for entry in entries):
        raise APIError(400, "prompt_embeds is not a tensor saved by torch.save: its archive has compressed records",
                       _FIELD)
