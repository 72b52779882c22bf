"""Errors a client can cause, and how each dialect spells them.

Handlers raise `APIError(status, message, param)`; the app renders it in the shape of the endpoint's
dialect: OpenAI `{"error": {message, type, param, code}}`, Anthropic `{"type": "error", "error": {type,
message}}`. Every bad request names the field it is about, so a 4xx is always actionable.
"""
from __future__ import annotations

from starlette.responses import JSONResponse

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
_OPENAI_TYPES = {401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error",
                 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad_request(param: str, message: str) -> APIError:
    """A 400 about one field; the message starts with the field's name so it is never ambiguous."""
    return APIError(400, f"{param}: {message}", param=param)


def openai_error_body(e: APIError) -> dict:
    return {"error": {"message": e.message, "type": _OPENAI_TYPES.get(e.status, "invalid_request_error"),
                      "param": e.param, "code": e.code}}


def anthropic_error_body(e: APIError) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(e.status, "invalid_request_error"),
                                       "message": e.message}}


def dialect_of(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_response(e: APIError, dialect: str) -> JSONResponse:
    body = anthropic_error_body(e) if dialect == "anthropic" else openai_error_body(e)
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(body, status_code=e.status, headers=headers)
