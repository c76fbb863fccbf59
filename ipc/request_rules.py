"""The rules every engine-core request must meet: the engine core enforces them, front ends check them early."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ipc.messages import EngineCoreRequest, EngineInfo
    from ipc.multimodal import ImageInput


class InvalidRequestError(ValueError):
    """A request no engine with these limits would run; `param` names the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def validate_request(info: EngineInfo, request: EngineCoreRequest) -> None:
    """Raise InvalidRequestError naming what is wrong with a request this engine would refuse."""
    if request.prompt_embeds is not None:
        _check_prompt_embeds(info, request)
    if request.pooling_params is not None:
        _check_pooling_request(info, request)
        return
    if info.runner == "pooling":
        raise InvalidRequestError("this model runs as a pooling model (runner 'pooling'): it embeds, scores and "
                                  "classifies, it does not generate", "model")
    context_room(info, len(request.prompt_token_ids))
    _check_token_ids(info, request)
    if request.mm_inputs:
        _check_images(info, request)
    params = request.sampling_params
    if params.n != 1:
        raise InvalidRequestError(f"an engine request samples once (n=1, got {params.n}); the front end sends "
                                  "n > 1 as n requests", "n")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > info.max_logprobs:
            raise InvalidRequestError(f"{name}={value} is over this engine's limit of {info.max_logprobs} "
                                      "(--max-logprobs)", name)
    if request.priority != 0 and info.scheduling_policy != "priority":
        raise InvalidRequestError(f"priority={request.priority} needs scheduling_policy='priority' (the engine "
                                  "runs first-come first-served)", "priority")


def context_room(info: EngineInfo, num_prompt_tokens: int) -> int:
    """How many tokens a prompt of this length leaves to generate (at least one, or InvalidRequestError)."""
    if num_prompt_tokens == 0:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if num_prompt_tokens >= info.max_model_len:
        raise InvalidRequestError(f"the prompt has {num_prompt_tokens} tokens, but this model's context length "
                                  f"(max_model_len) is {info.max_model_len}; shorten the prompt", "prompt")
    return info.max_model_len - num_prompt_tokens


def check_max_tokens(info: EngineInfo, num_prompt_tokens: int, max_tokens: int | None) -> None:
    """OpenAI's rule, which the HTTP gateway applies: prompt + max_tokens must fit in the context. (The engine
    itself ends a request that reaches the context length with finish_reason "length", as vLLM's LLM does.)"""
    room = context_room(info, num_prompt_tokens)
    if max_tokens is not None and max_tokens > room:
        raise InvalidRequestError(
            f"this model's context length is {info.max_model_len} tokens, but the request asks for "
            f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt + {max_tokens} max_tokens); "
            "reduce the prompt or max_tokens", "max_tokens")


def _check_token_ids(info: EngineInfo, request: EngineCoreRequest) -> None:
    params = request.sampling_params
    eos = [request.eos_token_id] if request.eos_token_id is not None else []
    token_ids = {"prompt": request.prompt_token_ids,
                 "stop_token_ids": [*(params.stop_token_ids or []), *eos],
                 "logit_bias": list(params.logit_bias or ()),
                 "bad_words": [t for word in params.bad_words_token_ids or [] for t in word]}
    if params.structured_outputs is not None and (section := params.structured_outputs.reasoning) is not None:
        token_ids["structured_outputs.reasoning"] = [*section.end_token_ids, *(
            [section.open_token_id] if section.open_token_id is not None else [])]
    for name, ids in token_ids.items():
        bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"{name} token id {bad} is outside the vocabulary [0, {info.vocab_size})",
                                      name)


def check_prompt_embeds_enabled(info: EngineInfo) -> None:
    """InvalidRequestError naming prompt_embeds unless this engine takes them (checked before any is decoded)."""
    if not info.enable_prompt_embeds:
        raise InvalidRequestError("this engine takes no prompt_embeds: start the server with --enable-prompt-embeds "
                                  "(LLM: enable_prompt_embeds=True)", "prompt_embeds")


def _check_prompt_embeds(info: EngineInfo, request: EngineCoreRequest) -> None:
    """Embeddings stand for the whole prompt of a generation request, one row per placeholder token id."""
    embeds = request.prompt_embeds
    check_prompt_embeds_enabled(info)
    if request.pooling_params is not None:
        raise InvalidRequestError("prompt_embeds are for generation requests; pooling takes token ids", "prompt_embeds")
    if embeds.hidden_size != info.hidden_size:
        raise InvalidRequestError(f"prompt_embeds rows have {embeds.hidden_size} values, but this model's hidden size "
                                  f"is {info.hidden_size}", "prompt_embeds")
    if embeds.num_rows >= info.max_model_len:
        raise InvalidRequestError(f"prompt_embeds has {embeds.num_rows} rows, but this model's context length "
                                  f"(max_model_len) is {info.max_model_len}; shorten the prompt", "prompt_embeds")
    if len(request.prompt_token_ids) != embeds.num_rows:
        raise InvalidRequestError(f"a prompt_embeds request has one placeholder token id per row: "
                                  f"{len(request.prompt_token_ids)} ids for {embeds.num_rows} rows", "prompt_embeds")
    if request.sampling_params.prompt_logprobs is not None:
        raise InvalidRequestError("prompt_logprobs are not defined for prompt_embeds (the prompt has no token ids)",
                                  "prompt_logprobs")


def _check_pooling_request(info: EngineInfo, request: EngineCoreRequest) -> None:
    pooling, params, num_tokens = info.pooling, request.pooling_params, len(request.prompt_token_ids)
    if pooling is None:
        raise InvalidRequestError("this model cannot pool: it serves generation requests only", "model")
    if num_tokens == 0:
        raise InvalidRequestError("the input is empty", "input")
    if num_tokens > info.max_model_len:
        raise InvalidRequestError(f"the input has {num_tokens} tokens, but this model takes at most "
                                  f"{info.max_model_len} (max_model_len); shorten it or set truncate_prompt_tokens",
                                  "input")
    bad = next((t for t in request.prompt_token_ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"input token id {bad} is outside the vocabulary [0, {info.vocab_size})", "input")
    if params.task == "classify" and not pooling.num_labels:
        raise InvalidRequestError("this model has no classification head: it embeds", "model")
    if params.task == "embed" and pooling.num_labels:
        raise InvalidRequestError("this model is a classifier: it classifies and scores, it does not embed", "model")
    if params.dimensions is not None:
        if not pooling.matryoshka:
            raise InvalidRequestError("this model does not support matryoshka representation: it cannot change its "
                                      "output dimensions", "dimensions")
        if params.dimensions > pooling.hidden_size:
            raise InvalidRequestError(f"dimensions={params.dimensions} is over the model's {pooling.hidden_size}",
                                      "dimensions")
    types = request.token_type_ids
    if types is not None:
        if len(types) != num_tokens:
            raise InvalidRequestError(f"token_type_ids has {len(types)} entries for {num_tokens} input tokens",
                                      "token_type_ids")
        if any(t >= pooling.type_vocab_size for t in types):
            raise InvalidRequestError(f"token_type_ids must be below {pooling.type_vocab_size} for this model",
                                      "token_type_ids")


def _check_images(info: EngineInfo, request: EngineCoreRequest) -> None:
    """Images only for a vision-language model, each over its own run of placeholder tokens (as many as the model's
    rule gives it), in prompt order."""
    if info.image_token_id is None:
        raise InvalidRequestError("this model takes no images (it is a text-only model)", "multi_modal_data")
    if request.prompt_embeds is not None:
        raise InvalidRequestError("give images with a prompt of token ids, not prompt_embeds", "multi_modal_data")
    end = 0
    for image in request.mm_inputs:
        length = _image_length(info, image)
        if image.length != length or image.offset < end or image.end > len(request.prompt_token_ids):
            raise InvalidRequestError(f"each image takes {length} placeholder tokens of its own, in prompt order; "
                                      f"got {image.length} at {image.offset}", "multi_modal_data")
        if image.hash != image.content_hash():
            raise InvalidRequestError("an image's hash must be the sha256 of its pixel values (ImageInput.of)",
                                      "multi_modal_data")
        if any(token != info.image_token_id for token in request.prompt_token_ids[image.offset:image.end]):
            raise InvalidRequestError(f"an image's placeholder positions {image.offset}..{image.end - 1} must hold "
                                      f"the image token {info.image_token_id}", "multi_modal_data")
        end = image.end


def _image_length(info: EngineInfo, image: ImageInput) -> int:
    """The placeholders an image takes: the model's fixed count, or by a tiling model's rule for the image's original
    size, whose tiles (shape [tiles, channels, tile, tile]) must be those the rule cuts."""
    tiling = info.image_tiling
    if tiling is None:
        if image.image_size is not None:
            raise InvalidRequestError("this model takes each image as one view [channels, height, width], without "
                                      "an image_size", "multi_modal_data")
        return info.image_feature_count
    if image.image_size is None:
        raise InvalidRequestError("this model tiles images: give pixel values [tiles, channels, height, width] and "
                                  "the image's original (height, width) image_size", "multi_modal_data")
    tiles = tiling.num_tiles(*image.image_size)
    if image.shape[0] != tiles or image.shape[2:] != (tiling.tile_size, tiling.tile_size):
        raise InvalidRequestError(f"an image of size {list(image.image_size)} is {tiles} tiles of "
                                  f"{tiling.tile_size} x {tiling.tile_size} pixels, got pixel values of shape "
                                  f"{list(image.shape)}", "multi_modal_data")
    return tiling.feature_count(*image.image_size)
