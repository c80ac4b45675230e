"""Structured logging: one line per event, JSON or console, always with the pod id.

Never log secrets or tokens, and never a whole event body at info level: pass ids as
``extra={"event_id": ..., "delivery_id": ...}`` instead.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, pod_id: str):
        super().__init__()
        self.pod_id = pod_id

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
        return json.dumps(out, default=str)


class ConsoleFormatter(logging.Formatter):
    def __init__(self, pod_id: str):
        super().__init__("%(asctime)s %(levelname)-7s %(name)s [" + pod_id + "] %(message)s%(extras)s")

    def format(self, record: logging.LogRecord) -> str:
        extras = {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_") and k != "extras"}
        record.extras = (" " + " ".join(f"{k}={v}" for k, v in extras.items())) if extras else ""
        return super().format(record)


def configure_logging(pod_id: str, fmt: str = "json", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(pod_id) if fmt == "json" else ConsoleFormatter(pod_id))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # hypercorn's access log is noisy and its error log duplicates ours
    logging.getLogger("hypercorn.access").setLevel(logging.WARNING)
