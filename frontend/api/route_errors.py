"""How the gateway's failures become OpenAI-style responses: the app's error handlers, and the wrapper that runs a
generation route, aborting it if the client leaves and answering a bug itself."""
from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from frontend.api.errors import APIError, engine_error, error_body, from_pydantic
from frontend.core_client import EngineDeadError

logger = logging.getLogger("pagedserve.api")
_CLIENT_CLOSED_REQUEST = 499  # nginx's status for it; never sent, the client is gone


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        return from_pydantic(list(error.errors())).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(error.status_code, str(error.detail)), status_code=error.status_code)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return engine_error(error).response()

    @app.exception_handler(Exception)
    async def bug(_: Request, error: Exception) -> JSONResponse:
        # Starlette raises the error again after this response is sent, so uvicorn still logs its traceback.
        return _bug_response(error)


def _bug_response(error: Exception) -> JSONResponse:
    return APIError(500, f"internal error ({type(error).__name__}); the server log has the details").response()


async def cancel_on_disconnect(request: Request, handler) -> Response:
    """Run a handler, cancelling it (and so aborting its engine requests) if the client goes away first."""
    task = asyncio.ensure_future(handler)
    client_gone = False

    async def watch() -> None:
        nonlocal client_gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        client_gone = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if not client_gone:  # the server itself is stopping this request
            raise
        # A client that gives up is routine, not a fault: no traceback (hundreds of them under load).
        logger.debug("%s %s: the client went away before the response; its request was aborted",
                     request.method, request.url.path)
        return Response(status_code=_CLIENT_CLOSED_REQUEST)
    except Exception as error:  # a bug: answered here, as Starlette's handler would re-raise it and uvicorn then
        # drops the keep-alive connection, so a client reusing it could read a reset instead of this 500
        if engine_error(error) is not None or isinstance(error, APIError):
            raise
        logger.exception("%s %s failed", request.method, request.url.path)
        return _bug_response(error)
    finally:
        watcher.cancel()
