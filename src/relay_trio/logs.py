"""Structured logging: one line per event, JSON or console, always with the pod id.

Never log secrets or tokens, and never a whole event body at info level: pass ids as
``extra={"event_id": ..., "delivery_id": ...}`` instead. As a second line of defence the
handler installed by ``configure_logging`` redacts, from every line it writes, the
configured tokens (``secrets=``) and anything shaped like a credential: ``Bearer <x>``,
``whsec_<x>`` webhook secrets and the password of a ``postgres://user:pw@`` DSN. The
tests check the first line of defence (the code) separately, on raw records.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Iterable

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

REDACTED = "[redacted]"
_PATTERNS = (
    (re.compile(r"(?i)(bearer\s+)[^\s\"',;]+"), r"\1" + REDACTED),
    (re.compile(r"whsec_[A-Za-z0-9+/=_-]+"), "whsec_" + REDACTED),
    (re.compile(r"(?i)(postgres(?:ql)?://[^:/@\s]+:)[^@\s]+@"), r"\1" + REDACTED + "@"),
)
MIN_SECRET_CHARS = 4  # shorter configured values would redact ordinary words


class Redactor:
    """Removes known secret values and credential-shaped substrings from log text."""

    def __init__(self, secrets: Iterable[str] = ()):
        values: set[str] = set()
        for s in secrets:
            if s and len(s) >= MIN_SECRET_CHARS:
                values.add(s)
                values.add(json.dumps(s)[1:-1])  # as it appears inside a JSON string
        # longest first, so a secret containing another is removed whole
        self.values = sorted(values, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for value in self.values:
            if value in text:
                text = text.replace(value, REDACTED)
        for pattern, repl in _PATTERNS:
            text = pattern.sub(repl, text)
        return text


class JsonFormatter(logging.Formatter):
    def __init__(self, pod_id: str, redactor: Redactor | None = None):
        super().__init__()
        self.pod_id = pod_id
        self.redact = redactor or Redactor()

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "pod": self.pod_id,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        # json.dumps escapes newlines: one record is always one line
        return self.redact(json.dumps(out, default=str))


class ConsoleFormatter(logging.Formatter):
    def __init__(self, pod_id: str, redactor: Redactor | None = None):
        super().__init__("%(asctime)s %(levelname)-7s %(name)s [" + pod_id + "] %(message)s%(extras)s")
        self.redact = redactor or Redactor()

    def format(self, record: logging.LogRecord) -> str:
        extras = {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_") and k != "extras"}
        record.extras = (" " + " ".join(f"{k}={v}" for k, v in extras.items())) if extras else ""
        return self.redact(super().format(record))


def configure_logging(pod_id: str, fmt: str = "json", level: str = "INFO", secrets: Iterable[str] = ()) -> logging.Handler:
    """Send every log record to stderr, one line each, with the pod id; ``secrets`` are
    values that must never appear in the output (tokens, DSN passwords)."""
    redactor = Redactor(secrets)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(pod_id, redactor) if fmt == "json" else ConsoleFormatter(pod_id, redactor))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # hypercorn's access log is noisy and its error log duplicates ours
    logging.getLogger("hypercorn.access").setLevel(logging.WARNING)
    return handler


def settings_secrets(settings) -> list[str]:
    """The configured values of a ``Settings`` that must never be logged."""
    from urllib.parse import urlsplit

    values = [*settings.ingest_token_list, settings.admin_token]
    if settings.database_url:
        try:
            password = urlsplit(settings.database_url).password
        except ValueError:
            password = None
        if password:
            values.append(password)
    return [v for v in values if v]
