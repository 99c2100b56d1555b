"""Errors a caller can cause. Each carries an HTTP status, a machine-readable code and a message that says
what to do; the API turns them into ``{"error": code, "detail": text}`` and the CLI prints the message."""

from __future__ import annotations

from typing import Any


class CoordinatorError(Exception):
    status = 400
    code = "bad_request"

    def __init__(
        self,
        detail: str,
        *,
        code: str | None = None,
        fields: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        flag: dict[str, Any] | None = None,
    ):
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        self.fields = fields
        self.headers = headers or {}
        self.flag = flag
        """Keyword arguments of :func:`coordinator.credit.flags.record_flag` for a refusal the organizers
        should see: the API writes the flag in its own unit of work, since the refused one is rolled back."""


class BadRequest(CoordinatorError):
    status = 400
    code = "bad_request"


class Unauthorized(CoordinatorError):
    status = 401
    code = "unauthorized"


class Forbidden(CoordinatorError):
    status = 403
    code = "forbidden"


class NotFound(CoordinatorError):
    status = 404
    code = "not_found"


class Conflict(CoordinatorError):
    status = 409
    code = "conflict"


class Invalid(CoordinatorError):
    status = 422
    code = "invalid"


class RateLimited(CoordinatorError):
    status = 429
    code = "rate_limited"


class TooLarge(CoordinatorError):
    status = 413
    code = "request_too_large"
