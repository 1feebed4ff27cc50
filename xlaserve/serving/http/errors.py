"""`ApiError`, the OpenAI-shaped error every failure of the HTTP API answers with (responses:
http/render.py), and `invalid_value`, the 400 most field checks raise.  A module of its own so
that protocol.py, structured.py and tools.py all raise it without importing each other."""

from __future__ import annotations

from typing import Any, ClassVar

from werkzeug.exceptions import HTTPException


class ApiError(Exception):
    """An error answered with an OpenAI-shaped body {"error": {message, type, param, code}}."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
        404: "invalid_request_error", 405: "invalid_request_error",
        413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
        503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    @classmethod
    def from_http(cls, e: HTTPException, max_body_bytes: int) -> ApiError:
        """A werkzeug HTTP error (body over `max_body_bytes`, no such route, wrong method)."""
        codes = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}
        msg = (f"Request body exceeds the limit of {max_body_bytes} bytes" if e.code == 413
               else e.description or e.name)
        return cls(e.code or 400, msg, None, codes.get(e.code or 400))


def invalid_value(param: str, why: str) -> ApiError:
    return ApiError(400, f"Invalid value for '{param}': {why}", param, "invalid_value")
