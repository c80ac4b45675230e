"""When to try again: per-row retry backoff, Retry-After, and whole-listener backoff.

Pure functions (the randomness is injectable) so the schedule is tested without clocks.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime

JITTER = 0.2  # +-20 %, like Svix: retries of many rows spread out instead of stampeding


def retry_delay(attempt: int, *, base: float, cap: float, rand: Callable[[], float] = random.random) -> float:
    """Delay before the retry that follows failed attempt number ``attempt`` (1-based).

    base * 2**(attempt-1) with +-20 % jitter, never above ``cap``: about 1 s, 2 s, 4 s, ...
    up to 5 min with the defaults.
    """
    exp = min(max(attempt - 1, 0), 62)
    nominal = min(cap, base * (2.0**exp))
    jittered = nominal * (1.0 - JITTER + 2 * JITTER * rand())
    return max(0.0, min(cap, jittered))


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None if absent/bad."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if value.isascii() and value.isdigit():  # "²".isdigit() is True; float("²") raises
        try:
            return float(value)
        except (ValueError, OverflowError):
            return None
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    now = now or datetime.now(timezone.utc)
    return max(0.0, (when - now).total_seconds())


def clamp_retry_after(seconds: float, *, base: float, cap: float) -> float:
    """Honour Retry-After within the schedule's bounds: no sooner than ``base``, no later than ``cap``."""
    return min(cap, max(base, seconds))


def listener_pause(level: int, *, base: float, cap: float) -> float:
    """Whole-listener backoff for ``level`` (1 at the first pause): base, 2*base, ... up to cap."""
    exp = min(max(level - 1, 0), 62)
    return min(cap, base * (2.0**exp))
