"""Errors as OpenAI sends them: `{"error": {"message", "type", "param", "code"}}`, never a 500
with a traceback. Every failure of a request ends here, with the status it deserves."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from stemma import protocol as P

logger = logging.getLogger("stemma.serve.http")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
         500: "internal_error", 503: "service_unavailable"}
STATUS_OF_CODE = {P.BAD_REQUEST: 400, P.TOO_LARGE: 413, P.UNAUTHORIZED: 401, P.ENGINE_DEAD: 503,
                  P.SHUTTING_DOWN: 503, P.OVERLOADED: 503, P.CUT_OFF: 503, P.INTERNAL: 500}


class ClientGone(Exception):
    """The HTTP client closed its connection before its answer was ready."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def unavailable(why: str, code: str = "unavailable") -> ApiError:
    """A 503; `code` is stemma's (engine_dead, shutting_down), "loading", or "unavailable"."""
    return ApiError(503, why, code=code)


def bad_field(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def from_server(msg: P.ErrorMsg, param: str | None = None) -> ApiError:
    """A protocol error reply as an HTTP error; its stemma code is kept as the error's code.
    `param`: the HTTP request's field that `msg.param` names."""
    return ApiError(STATUS_OF_CODE.get(msg.code, 500), msg.message, param=param, code=msg.code)


def _field_of(loc) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or "body"


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def on_api_error(_request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        # a body that is not JSON is located at a character offset, not at a field
        param = "body" if first.get("type") == "json_invalid" else _field_of(first.get("loc", ()))
        message = f"{param}: {first.get('msg', 'invalid value')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problems)"
        return JSONResponse(error_body(400, message, param, "invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            message = "no such route" if message == "Not Found" else message
        code = "too_large" if exc.status_code == 413 else None  # a chunked body past the limit
        return JSONResponse(error_body(exc.status_code, message, code=code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientGone)
    async def on_gone(_request: Request, _exc: ClientGone):
        # nobody reads this: the request was aborted when its peer closed
        return JSONResponse(error_body(400, "the client disconnected", code="client_gone"),
                            status_code=400)

    @app.exception_handler(Exception)
    async def on_bug(_request: Request, exc: Exception):
        logger.exception("internal error while serving an HTTP request")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"),
                            status_code=500)
