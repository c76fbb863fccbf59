"""Tool-call parsers for tool_choice "auto" (--tool-call-parser): the calls a model wrote in its own format, and
the text around them. A call that does not parse stays text: never an error, never a made-up call."""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable

ParsedOutput = tuple[str | None, list[dict]]  # (content, OpenAI tool_calls)


def tool_call(name: str, arguments: str) -> dict:
    """One OpenAI tool call; `arguments` is JSON text, as OpenAI sends it."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _call_from(obj: object, arguments_key: str) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return tool_call(obj["name"], json.dumps(arguments, ensure_ascii=False))


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> ParsedOutput:
    """Hermes/Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as many as written."""
    calls, kept, position = [], [], 0
    for match in _HERMES_CALL.finditer(text):
        try:
            call = _call_from(json.loads(match.group(1)), "arguments")
        except ValueError:
            call = None
        if call is None:
            continue  # stays in the content
        kept.append(text[position:match.start()])
        position = match.end()
        calls.append(call)
    content = ("".join(kept) + text[position:]).strip() if calls else text
    return (content or None), calls


def hermes_call_tags(parameters: dict[str, dict], forced: bool, one_call: bool) -> dict:
    """xgrammar's structural tag for calls in Hermes' format, each naming one of the tools with arguments valid
    against its schema: `forced`, nothing but calls (one at least); else free text, a call once begun kept valid.
    After one call, the end if `one_call`."""
    tags = [{"begin": f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": schema}, "end": "}\n</tool_call>"}
            for name, schema in parameters.items()]
    if forced:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True}
    else:
        calls = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags}
    return {"type": "structural_tag", "format": {**calls, "stop_after_first": one_call}}


def parse_llama3_json(text: str) -> ParsedOutput:
    """Llama 3's JSON tool format: the whole output is `{"name": ..., "parameters": {...}}` (after an optional
    <|python_tag|>), or several of them separated by ";"."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, index = json.JSONDecoder(), [], 0
    try:
        while index < len(body):
            obj, index = decoder.raw_decode(body, index)
            key = "arguments" if isinstance(obj, dict) and "parameters" not in obj else "parameters"
            call = _call_from(obj, key)
            if call is None:
                return text, []
            calls.append(call)
            index = len(body) - len(body[index:].lstrip().removeprefix(";").lstrip())
    except ValueError:
        return text, []
    return None, calls


# name → (parse, the text a call starts with: streamed content is held back from there)
TOOL_CALL_PARSERS: dict[str, tuple[Callable[[str], ParsedOutput], str]] = {
    "hermes": (parse_hermes, "<tool_call>"),
    "llama3_json": (parse_llama3_json, "{"),
}
# name → the constraint that writes calls in the parser's own format, for the formats whose calls open with a tag of
# their own: a forced choice is served in the form the model was trained to call in, and under "auto" a call once
# begun stays valid (a llama3_json call opens with "{", which free text may hold too: those keep OpenAI's forms)
CALL_CONSTRAINTS: dict[str, Callable[[dict[str, dict], bool, bool], dict]] = {"hermes": hermes_call_tags}


def held_back(text: str, marker: str) -> int:
    """Where streamed content must stop: the marker's start if it has appeared, else the start of a suffix that
    could still grow into it, else the end."""
    found = text.find(marker)
    if found >= 0:
        return found
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return len(text) - length
    return len(text)
