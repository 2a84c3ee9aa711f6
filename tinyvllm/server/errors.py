"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP
status the OpenAI client maps to its exception classes (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, ...)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# OpenAI's error "type" per status.
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raise from a route to answer with this status and message in OpenAI's shape."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def error_body(
    status: int, message: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence for pydantic's error list, and the first bad field."""
    parts, param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            parts.append(f"the body is not valid JSON ({ctx.get('error', err.get('msg'))})")
            continue
        if err.get("type") == "extra_forbidden":
            parts.append(f"unrecognized request argument supplied: {where}")
        else:
            parts.append(f"{where or 'body'}: {err.get('msg')}")
        param = param or where or None
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        body = error_body(exc.status, exc.message, exc.param, exc.code)
        return JSONResponse(body, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        if exc.status_code == 404:
            message = (
                f"no route {request.method} {request.url.path}; see GET /v1/models, "
                "POST /v1/completions, POST /v1/chat/completions"
            )
        return error_response(exc.status_code, message)
