"""The proxy's logs: text for people, or one JSON object per line (``--log-format json``) for log pipelines.

Each finished request can be logged with what happened to it (``request_done``): its id, the plan and instances,
the status, TTFT and end-to-end time, fallbacks and the worker. In JSON mode that line is at INFO (one per
request); in text mode at DEBUG, so a default text log has no line per request.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and goes into the JSON object.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure(level: str, fmt: str) -> int:
    """Set up the root logger; returns the level of the per-request line (INFO for json, DEBUG for text)."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # a library's warnings.warn() goes through the same handler (JSON too)
    return request_log_level(fmt)


def request_log_level(fmt: str) -> int:
    return logging.INFO if fmt == "json" else logging.DEBUG


class Occasional:
    """A warning a client can repeat at will, logged at most once per ``every_s`` with how many were left out in
    between (their counter still counts each)."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self._next = 0.0
        self._left_out = 0

    def due(self, now: float) -> int | None:
        """How many were left out since the last line, when one is due now; None (and this one left out) if not."""
        if now < self._next:
            self._left_out += 1
            return None
        left_out, self._left_out = self._left_out, 0
        self._next = now + self.every_s
        return left_out
