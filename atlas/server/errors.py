"""OpenAI-shaped errors: every failure a client sees is `{"error": {"message", "type", "param", "code"}}`.

Messages are written for the client: they name the parameter and the numbers, never a stack trace or a
file path. Anything unexpected becomes a generic 500 whose detail stays in the server log.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.responses import JSONResponse

# OpenAI's `type` values, by HTTP status
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client as the OpenAI error object with `status`; `close`: and the connection
    closed after it (a body left unread must not be parsed as the next request)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, close: bool = False
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.close = close

    @property
    def type(self) -> str:
        return _TYPE_BY_STATUS.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status,
                            headers={"connection": "close"} if self.close else None)

    def sse_event(self) -> bytes:
        """The error as one server-sent event (a stream that fails sends this, then `[DONE]`)."""
        return f"data: {json.dumps(self.body())}\n\n".encode()


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def engine_dead(detail: str | None = None) -> APIError:
    message = "the engine hit a fatal fault and is shutting down"
    if detail:
        message += f": {redact_paths(detail)}"
    return APIError(503, message, code="engine_dead")


_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][\w.@+-]+){2,}[/\\]?")


def redact_paths(text: str) -> str:
    """Error text from deep inside the engine may name files; the client is not told where they live."""
    return _PATH.sub("<path>", text)


def shutting_down(detail: str | None = None) -> APIError:
    """Refused or ended by a shutdown; `detail` says why this request (e.g. it outlived the grace)."""
    message = detail if detail and detail != "the server is shutting down" else "the server is shutting down"
    return APIError(503, f"{message}; retry elsewhere or later", code="shutting_down")


def engine_error(detail: str | None, request_id: str | None = None) -> APIError:
    """A request the engine failed: reported as an error, never as stop or length. The request id is the
    one in the trace, so the failure can be found and replayed."""
    which = f" ({request_id})" if request_id else ""
    message = f"the engine failed this request{which}: {redact_paths(detail or 'unknown error')}"
    return APIError(500, message, code="engine_error")
