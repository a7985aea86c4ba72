"""Production logging for the server: no locals in tracebacks, secrets redacted, accept errors rate-limited.

structlog's default console renderer formats exceptions with rich and `show_locals=True`: one client that
disconnected mid-body logged ~89 KB per event, including `given = b'Bearer KEY'` and the body bytes, and
spent ~0.6 s of event-loop time doing it. Here tracebacks are plain text (format_exc_info), every event
passes a redaction step (keys that name credentials or raw request data, and any registered secret
anywhere in any value), and uvicorn's and asyncio's stdlib records get the same redaction.
"""

from __future__ import annotations

import logging
import re
import time
import traceback
from typing import Any

import structlog

SENSITIVE_KEYS = frozenset({"authorization", "api_key", "apikey", "headers", "body", "given", "expected",
                            "password", "secret", "cookie", "x-api-key"})
REDACTED = "[redacted]"
_BEARER = re.compile(r"(?i)(bearer\s+)[^\s'\"]+")


class Redactor:
    """Removes registered secrets (the API key) and bearer credentials from log text."""

    def __init__(self) -> None:
        self._secrets: tuple[str, ...] = ()

    def add(self, secret: str | None) -> None:
        if secret and secret not in self._secrets:  # longest first, so a key that contains another goes whole
            self._secrets = tuple(sorted((*self._secrets, secret), key=len, reverse=True))

    def text(self, value: str) -> str:
        for secret in self._secrets:
            if secret in value:
                value = value.replace(secret, REDACTED)
        return _BEARER.sub(r"\1" + REDACTED, value)

    def value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, bytes | bytearray):
            return f"[{len(value)} bytes]"
        if value is None or isinstance(value, bool | int | float):
            return value
        return self.text(repr(value))

    def __call__(self, _logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        for key, value in event_dict.items():
            event_dict[key] = REDACTED if key.lower() in SENSITIVE_KEYS else self.value(value)
        return event_dict


REDACTOR = Redactor()  # process-wide: the server registers its key here


class _StdlibRedaction(logging.Filter):
    """The same redaction for stdlib records (uvicorn's error log, asyncio), tracebacks rendered plain."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = REDACTOR.text(record.getMessage())
        record.args = ()
        if record.exc_info:
            record.exc_text = REDACTOR.text("".join(traceback.format_exception(*record.exc_info)).rstrip())
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = REDACTOR.text(record.exc_text)
        return True


class _RateLimit(logging.Filter):
    """One line per `every` seconds for records whose message contains `marker`, no traceback, with the count
    it stands for. asyncio logs a traceback for every failed accept (EMFILE at the fd limit): 3 million lines in
    1.5 minutes under a flood; uvicorn logs a line for every malformed request."""

    def __init__(self, marker: str, every: float = 10.0) -> None:
        super().__init__()
        self.marker = marker
        self.every = every
        self._last = -float("inf")
        self._dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.marker not in str(record.msg):
            return True
        now = time.monotonic()
        if now - self._last < self.every:
            self._dropped += 1
            return False
        if self._dropped:
            record.msg = f"{record.getMessage()} ({self._dropped} more like it since the last report)"
            record.args = ()
        record.exc_info, record.exc_text = None, None
        self._last, self._dropped = now, 0
        return True


def configure_logging(level: str = "info") -> None:
    """structlog for production: level filter, timestamp, plain tracebacks, redaction, console lines."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False),
            structlog.processors.format_exc_info,  # plain text, never rich's frames with their locals
            REDACTOR,
            structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
    )


def install_stdlib_redaction() -> None:
    """Call after uvicorn configured its loggers (uvicorn.Config does, when built)."""
    redaction = _StdlibRedaction()
    names = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi", "asyncio")
    for name in names:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _StdlibRedaction) for f in handler.filters):
                handler.addFilter(redaction)
    asyncio_log = logging.getLogger("asyncio")
    for logger, marker in ((asyncio_log, "accept"), (logging.getLogger("uvicorn.error"), "Invalid HTTP request")):
        if not any(isinstance(f, _RateLimit) and f.marker == marker for f in logger.filters):
            logger.addFilter(_RateLimit(marker))
    if not asyncio_log.handlers and not logging.getLogger().handlers:
        # asyncio's records would reach Python's last-resort handler unfiltered: give them a redacting one
        handler = logging.StreamHandler()
        handler.addFilter(redaction)
        asyncio_log.addHandler(handler)
