"""OpenAI Responses API request bodies (POST /v1/responses): input items (text and images), function tools,
text.format."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from frontend.api.protocol import SP, FunctionDefinition, Rule, _one_of, _Strict, refuse_media, require_fields

LOGPROBS = "message.output_text.logprobs"  # the one extra output data `include` can ask for here
_MEDIA = {"input_file": "files", "input_audio": "audio"}
# Fields whose other values would change the output; the rest of OpenAI's (metadata, user, service_tier,
# safety_identifier, prompt_cache_key, stream_options) change nothing here and are accepted.
REFUSED = {
    "background": Rule("responses run while their request is open", _one_of(False)),
    "conversation": Rule("conversations are not stored: continue with previous_response_id"),
    "max_tool_calls": Rule("not implemented: tool_choice and parallel_tool_calls bound the calls"),
    "prompt": Rule("stored prompt templates are not available"),
    "reasoning": Rule("the served model has no reasoning settings"),
    "truncation": Rule("prompts are never truncated: send a shorter one", _one_of("disabled")),
    "n": Rule("one output per response", _one_of(1)),
}


class ContentPart(_Strict):
    """A message's part: input_text, output_text (an earlier response's output sent back) or input_image (an image
    URL, loaded and checked as a chat image_url part is)."""

    type: Literal["input_text", "output_text", "input_image"]
    text: str | None = None
    image_url: str | None = None
    # Taken and of no effect: the model's image processor sets the size an image is seen at.
    detail: Literal["auto", "low", "high", "original"] = "auto"
    refused_fields = {"file_id": Rule("uploaded files are not stored here: send the image as image_url")}

    @model_validator(mode="before")
    @classmethod
    def _no_files_or_audio(cls, part: Any) -> Any:
        return refuse_media(part, _MEDIA)

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> ContentPart:
        require_fields(self, ("image_url",) if self.type == "input_image" else ("text",), f"{self.type} part")
        return self

    def chat_part(self) -> dict:
        """The part as a chat message's content part."""
        if self.type == "input_image":
            return {"type": "image_url", "image_url": {"url": self.image_url}}
        return {"type": "text", "text": self.text}


class InputItem(_Strict):
    """One item of `input`: a message, a function call the model made, or the output of one."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = Field(default=None, min_length=1)
    name: str | None = None
    arguments: str | None = None
    output: str | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> InputItem:
        needed = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                  "function_call_output": ("call_id", "output")}[self.type]
        require_fields(self, needed, f"{self.type} item")
        return self


class FunctionTool(FunctionDefinition):
    """A Responses function tool: the chat tool's function, flat."""

    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, tool: Any) -> Any:
        if isinstance(tool, dict) and tool.get("type") != "function":
            raise PydanticCustomError("unsupported_tool", "only function tools are served here, not {kind!r}",
                                      {"field": "type", "kind": str(tool.get("type"))[:64]})
        return tool


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced

    @model_validator(mode="after")
    def _schema_when_asked(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise PydanticCustomError("json_schema", "a json_schema format needs name and schema",
                                      {"field": "name" if self.name is None else "schema"})
        return self

    def response_format(self) -> dict | None:
        """The chat request's response_format for this format (None: plain text)."""
        if self.type != "json_schema":
            return None if self.type == "text" else {"type": "json_object"}
        described = {} if self.description is None else {"description": self.description}
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.schema_, **described}}


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one this server writes


class ResponsesRequest(_Strict):
    model: str | None = None  # None: the model this server has
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: SP["max_tokens"] = None
    temperature: SP["temperature"] | None = None
    top_p: SP["top_p"] | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    refused_fields = REFUSED

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self) -> ResponsesRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("top_logprobs", f"top_logprobs needs include [{LOGPROBS!r}]",
                                      {"field": "top_logprobs"})
        return self

    @property
    def logprobs(self) -> bool:
        """Whether the output text's logprobs are asked for."""
        return LOGPROBS in (self.include or ())
