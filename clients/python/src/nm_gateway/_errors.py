"""The library's exceptions, and reading the gateway's `NM-Error` code off an SDK's exception.

Proxy errors are never wrapped: a request through a wired SDK client raises that SDK's own
exception (`openai.AuthenticationError`, `google.genai.errors.ClientError`, ...), because the
gateway answers in each provider's native error shape. `error_code(exc)` reads the gateway's
contract code (`NM-Error`) from whichever response the exception carries.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = [
    "ConfigError",
    "InvalidSignal",
    "NMGatewayError",
    "SignalError",
    "error_code",
    "request_id",
]


class NMGatewayError(Exception):
    """Base class of every exception this library raises itself."""


class ConfigError(NMGatewayError, ValueError):
    """A setting (argument or `NM_*` environment variable) is missing or malformed."""


class SignalError(NMGatewayError):
    """A signal was not stored.

    - `code`: the endpoint's error code (`invalid_session_id`, `unavailable`, ...), or
      `connection_error` when the gateway could not be reached.
    - `status`: the HTTP status, or None when no answer came (or the check was client-side).
    - `retryable`: the failure was transient (503, 429, connection); retries were exhausted.
    - `request_id`: the `NM-Request-Id` of the last answer, for support.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        status: Optional[int] = None,
        retryable: bool = False,
        request_id: Optional[str] = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status
        self.retryable = retryable
        self.request_id = request_id


class InvalidSignal(SignalError, ValueError):
    """The signal breaks one of the endpoint's rules; it was never sent.

    `code` is the code the endpoint would have answered (`invalid_session_id`,
    `invalid_action`, `edit_distance_required`, `invalid_edit_distance`, `invalid_field`).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)


def _response_headers(exc: BaseException) -> Any:
    """The headers of the HTTP answer behind an SDK exception, if it carries one."""
    for attr in ("response", "raw_response", "http_response"):
        resp = getattr(exc, attr, None)
        headers = getattr(resp, "headers", None)
        if headers is not None:
            return headers
    return getattr(exc, "headers", None)


def _header(exc: BaseException, name: str) -> Optional[str]:
    headers = _response_headers(exc)
    if headers is None:
        return None
    try:
        value = headers.get(name)
    except Exception:  # an unexpected headers type: no code rather than a new error
        return None
    return value if isinstance(value, str) and value else None


def error_code(exc: BaseException) -> Optional[str]:
    """The gateway's `NM-Error` code behind an SDK exception (`invalid_api_key`,
    `budget_exceeded`, ...), or None when the error came from the provider itself (or from
    no answer at all). Also works on `SignalError`."""
    if isinstance(exc, SignalError):
        return exc.code
    return _header(exc, "nm-error")


def request_id(exc: BaseException) -> Optional[str]:
    """The `NM-Request-Id` of the answer behind an SDK exception (or a `SignalError`)."""
    if isinstance(exc, SignalError):
        return exc.request_id
    return _header(exc, "nm-request-id")
