"""OpenAI-style errors: every failure is `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status."""
from __future__ import annotations

import logging
from http import HTTPStatus
from typing import NoReturn

from fastapi.responses import JSONResponse

from frontend.core_client import EngineDeadError, EngineOverloadedError, RequestFailedError

logger = logging.getLogger("pagedserve.api")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          408: "invalid_request_error", 413: "invalid_request_error", 431: "invalid_request_error",
          429: "rate_limit_exceeded", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": _valid_unicode(message), "type": kind,
                      "param": None if param is None else _valid_unicode(param),
                      "code": code if code is not None else HTTPStatus(status).phrase}}


def _valid_unicode(text: str) -> str:
    """`text` with any lone surrogate (echoed from a client's JSON) spelled out as "\\udXXX": the JSON encoder
    writes UTF-8, which has no encoding for one, so the error response itself would fail with a 500."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def from_pydantic(errors: list[dict]) -> APIError:
    """The first validation problem, named by its JSON path (e.g. messages.0.role). A check over the whole object
    (a refused field, say) names its field in ctx["field"]."""
    first = errors[0]
    path = [str(part) for part in first.get("loc", ()) if part != "body"]
    field = (first.get("ctx") or {}).get("field")
    param = ".".join(path + [field] if isinstance(field, str) else path) or None
    return APIError(400, f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", ""), param)


def engine_error(error: Exception) -> APIError | None:
    """The HTTP error an engine-side failure maps to (None: not one of ours, a bug)."""
    if isinstance(error, EngineOverloadedError):
        return APIError(429, str(error), code="overloaded")
    if isinstance(error, EngineDeadError):  # why goes to the log: it names the engine's address and internals
        logger.info("answering 503: %s", error)
        return APIError(503, "the engine is not available; see the server's log", code="engine_dead")
    if isinstance(error, RequestFailedError):  # the engine logged it; the gateway has no traceback to add
        return APIError(500, str(error), code="request_failed")
    if isinstance(error, ValueError):  # the request breaks a rule (InvalidRequestError names the field)
        return APIError(400, str(error), getattr(error, "param", None))
    return None


def raise_api_error(error: Exception) -> NoReturn:
    """Raise the HTTP error `error` maps to, or `error` itself if it is a bug (a 500)."""
    mapped = engine_error(error)
    if mapped is None:
        raise error
    raise mapped from error
