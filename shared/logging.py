"""Structured logging: one JSON object per line on stderr, with secrets redacted."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

_URL_PASSWORD = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@/\s]+)@")
# NATS takes a bare token as the user info (nats://TOKEN@host): no colon, but a secret all the same
_NATS_TOKEN = re.compile(r"(?P<scheme>\b(?:nats|tls|ws|wss)://)(?P<token>[^:/@\s,]+)@")
_BEARER = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+")
_TOKEN_KV = re.compile(r"(?i)((?:token|password|secret)[\"']?\s*[=:]\s*[\"']?)[^\s\"',}]+")

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


def redact(text: str) -> str:
    """Mask passwords in URLs, NATS tokens in URLs, bearer tokens and `token=`/`password=` values."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    text = _NATS_TOKEN.sub(lambda m: f"{m['scheme']}***@", text)
    text = _BEARER.sub(r"\1***", text)
    return _TOKEN_KV.sub(r"\1***", text)


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line; extra fields given with `extra=` are kept."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                payload[key] = redact(value) if isinstance(value, str) else value
        if record.exc_info:
            payload["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(payload, default=str)


class TextFormatter(logging.Formatter):
    """Human-readable lines for terminals, secrets redacted."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def configure_logging(level: str = "INFO", fmt: str = "json") -> None:
    """Install the project's formatter on the root logger (idempotent)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("asyncio", "nats", "aiohttp.access", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
