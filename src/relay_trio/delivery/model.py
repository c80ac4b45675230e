"""Values passed between the delivery loop, its store and its sender (no I/O here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class ClaimedRow:
    """A leased outbox row with everything needed to send it."""

    id: int
    listener: str
    attempt: int  # 1 on the first claim
    token: int  # fencing token of this claim
    url: str = ""
    secret: str = ""
    event: dict[str, Any] = field(default_factory=dict)
    age_seconds: float = 0.0  # row creation (commit) -> this claim
    overdue_seconds: float = 0.0  # due_at -> this claim


# Outcomes of one attempt.
DELIVERED = "delivered"  # 2xx
GONE = "gone"  # 410: disable the listener
THROTTLED = "throttled"  # 429 / 503: honour Retry-After
HTTP_ERROR = "http_error"  # any other status (3xx included: redirects are never followed)
TIMEOUT = "timeout"  # the attempt's deadline passed
CONNECT_ERROR = "connect_error"  # refused, reset, DNS, TLS, refused target address...


@dataclass(frozen=True)
class AttemptResult:
    outcome: str
    started_at: datetime
    duration_ms: float
    status_code: int | None = None
    error: str | None = None
    response_body: str | None = None  # first 1 KiB, decoded leniently
    retry_after: float | None = None  # seconds, when the response said so

    @property
    def ok(self) -> bool:
        return self.outcome == DELIVERED


@dataclass(frozen=True)
class Settled:
    """What settling an attempt did to the row: delivered | retried | dead | stale."""

    result: str
    delivered_age: float | None = None  # commit -> delivered seconds, when delivered
