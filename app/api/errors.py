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


SHOULD = "Input should be "  # how pydantic begins each type's failure


def invalid(error: ValidationError | RequestValidationError) -> ApiError:
    """The first problem pydantic found, named by its field path (`messages.0.role`).

    A field that takes one of several types (`stop`: a string or a list) fails once per
    type; the failure of the type the client did send says what is wrong (`stop`: at most 4
    items), and where none matched, every type the field takes is named.
    """
    problems = error.errors()
    matched = [p for p in problems if not p["type"].endswith("_type")]
    first = matched[0] if matched else problems[0]
    where = field_path(first.get("loc", ()))
    if matched:
        said = str(first.get("msg", "invalid")).removeprefix("Value error, ")  # our own check
    else:
        wanted = [p["msg"] for p in problems if field_path(p.get("loc", ())) == where]
        said = " or ".join(dict.fromkeys(m.removeprefix(SHOULD) for m in wanted))
        said = SHOULD + said if wanted[0].startswith(SHOULD) else said
    message = f"{where}: {said}" if where else said
    return ApiError(400, message, param=where or None, code="invalid_value")


def field_path(loc: tuple[int | str, ...]) -> str:
    """`messages.0.content` from pydantic's location, without the body and the type tags
    (`str`, `list[TextPart]`) it adds for each type a field may take."""
    return ".".join(str(part) for part in loc if part != "body" and not _type_tag(part))


def _type_tag(part: int | str) -> bool:
    return isinstance(part, str) and (
        part in {"str", "int", "float", "bool", "none"} or "[" in part or part[:1].isupper()
    )


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
