"""What the Responses and Messages APIs share: their requests as chat requests, their refusals in their own shape
naming the field at fault, and their named SSE events."""
from __future__ import annotations

import re
from collections.abc import Callable

import msgspec
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from frontend.api.errors import APIError, engine_error, from_pydantic
from frontend.api.protocol import ChatCompletionRequest

_json = msgspec.json.Encoder()
# pydantic's names for the branch of a union it tried (str, list[...], function-after[...]): not part of the JSON path
_BRANCH = re.compile(r"\[|^(str|int|float|bool|dict|list|none)$")


def chat_request(fields: dict, renamed: dict[str, str]) -> ChatCompletionRequest:
    """The chat request another API's request stands for; a 400 naming the field as the client sent it (`renamed`:
    chat field → the client's) if the chat path refuses it."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:
        raise rename_param(validation_error(list(error.errors())), renamed) from None


def rename_param(error: APIError, renamed: dict[str, str]) -> APIError:
    """`error` with its param (its first part, e.g. messages.0 → input.0) named as the client's API names it, in
    the message that starts with it too."""
    if error.param is not None:
        head, dot, rest = error.param.partition(".")
        param = renamed.get(head, head) + dot + rest
        if error.message.startswith(f"{error.param}:"):
            error.message = param + error.message[len(error.param):]
        error.param = param
    return error


def validation_error(errors: list[dict]) -> APIError:
    """The 400 of a body that failed validation: of the problems pydantic lists (one per branch of a union), the
    deepest, named by its JSON path."""
    deepest = max(errors, key=lambda error: len(error.get("loc", ())))
    if deepest.get("type") == "json_invalid":  # its loc is a position in the text, not a field
        return APIError(400, f"the request body is not valid JSON: {(deepest.get('ctx') or {}).get('error', '')}")
    loc = tuple(deepest.get("loc", ()))
    if loc[:1] in (("query",), ("path",)):  # a URL's parameter: named as the client wrote it
        loc = loc[1:]
    path = tuple(part for part in loc if not (isinstance(part, str) and _BRANCH.search(part)))
    return from_pydantic([{**deepest, "loc": path}])


def error_route(render: Callable[[APIError], Response]) -> type[APIRoute]:
    """A route class whose refusals (invalid bodies, APIErrors, engine failures) are answered in `render`'s shape."""

    class ErrorShapedRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def route(request) -> Response:
                try:
                    return await handler(request)
                except RequestValidationError as error:
                    return render(validation_error(list(error.errors())))
                except APIError as error:
                    return render(error)
                except HTTPException as error:  # a body over the size limit
                    return render(APIError(error.status_code, str(error.detail)))
                except Exception as error:
                    if (mapped := engine_error(error)) is None:
                        raise
                    return render(mapped)
            return route
    return ErrorShapedRoute


def named_event(name: str, body: dict) -> bytes:
    """One server-sent event with its name on an event: line, as the Responses and Messages streams send them."""
    return b"event: " + name.encode() + b"\ndata: " + _json.encode(body) + b"\n\n"
