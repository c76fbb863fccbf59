"""Anthropic Messages API request bodies (POST /v1/messages and its count_tokens): content blocks, tools,
tool_choice."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from frontend.api.protocol import SP, Rule, _one_of, _Strict, given_only_with_type, refuse_media, require_fields

_MEDIA = {"document": "documents"}
# Fields whose other values would change the output; metadata and service_tier change nothing here.
REFUSED = {
    "thinking": Rule("the served model has no extended thinking",
                     lambda value, body: value is None or value == {"type": "disabled"}),
    "mcp_servers": Rule("MCP servers are not available", _one_of([])),
    "container": Rule("code execution containers are not available"),
    "context_management": Rule("the context is never edited: send a shorter conversation"),
    "n": Rule("one message per request", _one_of(1)),
}


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ImageSource(_Strict):
    """An image block's source: base64 data with its media type, or a URL (loaded as a chat image_url is)."""

    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> ImageSource:
        require_fields(self, {"base64": ("media_type", "data"), "url": ("url",)}[self.type], f"{self.type} source")
        return self

    def chat_url(self) -> str:
        """The source as a chat image_url part's URL."""
        return self.url if self.type == "url" else f"data:{self.media_type};base64,{self.data}"


class ContentBlock(_Strict):
    """A text, image, tool_use or tool_result block (each with its own fields); documents are refused."""

    type: Literal["text", "image", "tool_use", "tool_result"]
    text: str | None = None
    source: ImageSource | None = None  # image
    id: str | None = Field(default=None, min_length=1)  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = Field(default=None, min_length=1)  # tool_result
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, block: Any) -> Any:
        return refuse_media(block, _MEDIA)

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> ContentBlock:
        needed = {"text": ("text",), "image": ("source",), "tool_use": ("id", "name", "input"),
                  "tool_result": ("tool_use_id",)}[self.type]
        require_fields(self, needed, f"{self.type} block")
        return self

    def result_text(self) -> str:
        """A tool_result's content as text (an error result says so, as the model should know)."""
        content = self.content if isinstance(self.content, str) or self.content is None else "\n".join(
            block.text for block in self.content)
        return f"Error: {content or ''}" if self.is_error else content or ""


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Strict):
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, bash...) are not available
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="after")
    def _object_schema(self) -> Tool:
        if self.input_schema.get("type") != "object":  # a tool's input is an object, as Anthropic requires
            raise PydanticCustomError("input_schema", 'input_schema must have "type": "object"',
                                      {"field": "input_schema"})
        return self


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_for_a_tool(self) -> ToolChoice:
        return given_only_with_type(self, "name", "tool", "tool_choice")


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None
    refused_fields = {"effort": Rule("the served model has no effort setting")}


class MessagesPrompt(_Strict):
    """What the prompt is made of: the body of POST /v1/messages/count_tokens, and the start of a messages body."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    refused_fields = REFUSED


class MessagesRequest(MessagesPrompt):
    max_tokens: SP["max_tokens"]
    stop_sequences: SP["stop"] = None
    temperature: SP["temperature"] | None = None
    top_p: SP["top_p"] | None = None
    top_k: SP["top_k"] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
