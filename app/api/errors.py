"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with the HTTP
status a client's library maps to its own exception (400 BadRequestError, 401, 404, 413, 429)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """A request refused or failed, with what the client is told."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def invalid(error: ValidationError | RequestValidationError) -> ApiError:
    """The first problem pydantic found, named by its field path (`messages.0.role`)."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    message = f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg"))
    return ApiError(400, message, param=where or None, code="invalid_value")


async def on_api_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ApiError)
    return error.response()


async def on_http_error(_request: Request, error: Exception) -> JSONResponse:
    """Starlette's own refusals (an unknown path 404, a wrong method 405) in OpenAI's shape."""
    assert isinstance(error, HTTPException)
    return ApiError(error.status_code, str(error.detail)).response()


async def on_validation_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    return invalid(error).response()
