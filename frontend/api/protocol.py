"""OpenAI request bodies (pydantic, strict types: "5" is not an int here); the responses: frontend/api/responses.py."""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from frontend.api.bounds import Mirrored, mirror
from ipc.sampling_params import LogitBias, SamplingParams

logger = logging.getLogger("pagedserve.api")
SP = Mirrored(SamplingParams)  # a SamplingParams field's type and bounds, for the field of the same meaning


def _absent(value: Any, body: Mapping) -> bool:
    return value is None


@dataclass(frozen=True)
class Rule:
    """A field this server does not implement: values that change nothing pass `accepts`, any other is a 400."""

    reason: str
    accepts: Callable[[Any, Mapping], bool] = _absent


def _one_of(*harmless: Any) -> Callable[[Any, Mapping], bool]:
    return lambda value, body: value is None or any(value == h and type(value) is type(h) for h in harmless)


_TOOLS = "the legacy function-calling fields are not implemented: use tools and tool_choice"
# Each field's rule and why it cannot be ignored; vLLM's extra fields among them. Fields that change nothing
# here are accepted: guided_decoding_backend, priority, user, metadata, store, service_tier, reasoning_effort,
# prediction.
COMMON = {
    "logits_processors": Rule("the server loads no custom logits processors", _one_of([])),
    "vllm_xargs": Rule("the server loads no custom logits processors to read them", _one_of({})),
    "truncate_prompt_tokens": Rule("prompts are never truncated: send a shorter one"),
    "allowed_token_ids": Rule("not implemented: logit_bias or bad_words can keep tokens out"),
    "return_tokens_as_token_ids": Rule("logprobs name their tokens as text", _one_of(False)),
}
COMPLETION_ONLY = {
    "suffix": Rule("fill-in-the-middle is not supported"),
    "best_of": Rule("best_of other than n (ranking extra samples on the server) is not implemented",
                    lambda value, body: value is None or value == body.get("n", 1)),
    "add_special_tokens": Rule("prompts always get the tokenizer's special tokens", _one_of(True)),
}
_CHAT_PROMPT = {
    "continue_final_message": Rule("not implemented: the last message is always closed", _one_of(False)),
    "documents": Rule("the template gets messages and add_generation_prompt only", _one_of([])),
}
CHAT_ONLY = _CHAT_PROMPT | {
    "functions": Rule(_TOOLS, _one_of([])),
    "function_call": Rule(_TOOLS, _one_of("none")),
    "echo": Rule("vLLM's chat echo is not implemented", _one_of(False)),
    "add_special_tokens": Rule("the chat template's text is tokenized without added special tokens", _one_of(False)),
    "audio": Rule("this server answers in text only"),
    "modalities": Rule("this server answers in text only", _one_of(["text"])),
    "web_search_options": Rule("web search is not available"),
}
TOKENIZE = _CHAT_PROMPT | {
    "tools": Rule("/tokenize renders messages without tools", _one_of([])),
    "chat_template": Rule("the server uses the model's template (or its --chat-template)"),
    "add_generation_prompt": Rule("messages are tokenized with the generation prompt", _one_of(True)),
}
_MAX_NAMES_LOGGED = 1000
_logged_names: set[str] = set()


def _check_fields(body: Any, known: Mapping[str, Any], refused: Mapping[str, Rule], model: str) -> None:
    """A 400 naming the first field in `refused` whose value would change the output; log unknown fields once."""
    if not isinstance(body, dict):
        return  # not an object: the model's own validation says so
    for name, value in body.items():
        rule = refused.get(name)
        if rule is not None and not rule.accepts(value, body):
            raise PydanticCustomError("unsupported_field", f"not supported by this server: {rule.reason}",
                                      {"field": name})
        # The names come from clients: past so many, new ones go unlogged rather than unbounded into memory.
        if rule is None and name not in known and name not in _logged_names and len(_logged_names) < _MAX_NAMES_LOGGED:
            _logged_names.add(name)
            logger.debug("%s: ignoring the unknown field %r (logged once)", model, name)


def refuse_media(value: Any, media: Mapping[str, str]) -> Any:
    """For a before-validator: a content part whose type is in `media` (type → what it carries) is refused by name."""
    if isinstance(value, dict) and value.get("type") in media:
        raise PydanticCustomError("unsupported_content", f"{value['type']}: {media[value['type']]} are not "
                                  "supported, the served model reads text only", {"field": "type"})
    return value


def require_fields(model: BaseModel, needed: tuple[str, ...], kind: str) -> None:
    """For an after-validator of a model whose fields depend on its type: each of `needed` is given."""
    for field in needed:
        if getattr(model, field) is None:
            raise PydanticCustomError("missing", f"a {kind} needs {field}", {"field": field})


class _Strict(BaseModel):
    """Known fields must have the right JSON type. Unknown ones are ignored, as OpenAI does (and logged once at
    DEBUG), except those in `refused_fields` whose value would change the output: those are a 400 naming them."""

    model_config = ConfigDict(strict=True, extra="ignore")
    refused_fields: ClassVar[dict[str, Rule]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, body: Any) -> Any:
        _check_fields(body, cls.model_fields, cls.refused_fields, cls.__name__)
        return body


class StreamOptions(_Strict):
    include_usage: bool = False
    refused_fields = {"continuous_usage_stats": Rule("usage comes in the stream's last chunk only", _one_of(False))}


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced


def given_only_with_type(model: BaseModel, field: str, kind: str, error_type: str) -> BaseModel:
    """The model, if `field` is set exactly when its `type` is `kind`; else a validation error naming the field."""
    if (model.type == kind) != (getattr(model, field) is not None):
        raise PydanticCustomError(error_type, f"{field} is given with type '{kind}', and only then",
                                  {"field": field})
    return model


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # type "structural_tag" (vLLM's): xgrammar's `format`, or the older `structures` and `triggers`
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self) -> ResponseFormat:
        return given_only_with_type(self, "json_schema", "json_schema", "json_schema")


class SamplingFields(_Strict):
    """Fields both endpoints share; top_k, min_p, min_tokens, ignore_eos... are vLLM's extra fields."""

    model: str | None = None  # None: the model this server has
    n: SP["n"] = 1
    temperature: SP["temperature"] | None = None
    top_p: SP["top_p"] | None = None
    seed: SP["seed"] = None
    stop: SP["stop"] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: SP["presence_penalty"] = 0.0
    frequency_penalty: SP["frequency_penalty"] = 0.0
    user: str | None = None
    top_k: SP["top_k"] | None = None
    min_p: SP["min_p"] | None = None
    repetition_penalty: SP["repetition_penalty"] | None = None
    min_tokens: SP["min_tokens"] = 0
    ignore_eos: bool = False
    stop_token_ids: SP["stop_token_ids"] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, mirror(LogitBias)] | None = None  # token id (as a JSON key) → bias
    bad_words: SP["bad_words"] = None
    cache_salt: str | None = None  # requests with different salts never share cached KV blocks
    prompt_logprobs: SP["prompt_logprobs"] = None  # vLLM's: per prompt token, its logprob and the best N
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    # The output's constraint: OpenAI's response_format, vLLM's structured_outputs or its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # StructuredOutputsParams' fields
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's beam search: n beams per prompt, ranked by cumulative logprob / length ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    # vLLM's: each prompt as base64 text of a torch.save'd [seq_len, hidden_size] tensor (frontend/api/prompt_embeds.py)
    prompt_embeds: str | list[str] | None = None
    max_tokens: SP["max_tokens"] = 16
    echo: bool = False
    logprobs: SP["logprobs"] = None
    refused_fields = COMMON | COMPLETION_ONLY

    @model_validator(mode="after")
    def _prompt_or_embeds(self) -> CompletionRequest:
        """A prompt, or embeddings with the prompt absent or empty (as vLLM's clients send them)."""
        if self.prompt_embeds is None and self.prompt is None:
            raise PydanticCustomError("missing", "give prompt (or prompt_embeds)", {"field": "prompt"})
        if self.prompt_embeds is not None and self.prompt not in (None, "", []):
            raise PydanticCustomError("prompt_embeds", "give prompt or prompt_embeds, not both",
                                      {"field": "prompt_embeds"})
        return self


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # the schema is always enforced when a call is forced


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: SP["max_tokens"] = None
    max_completion_tokens: SP["max_tokens"] = None
    chat_template: str | None = None  # refused when given: templates run code-like Jinja on the server
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: SP["logprobs"] = None
    tools: list[ChatTool] | None = Field(default=None, max_length=128)
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. enable_thinking
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    refused_fields = COMMON | CHAT_ONLY


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    refused_fields = TOKENIZE


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Strict):
    lora_name: Annotated[str, Field(min_length=1, max_length=512)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]  # under the server's --lora-dir


class UnloadLoRAAdapterRequest(_Strict):
    lora_name: Annotated[str, Field(min_length=1, max_length=512)]
