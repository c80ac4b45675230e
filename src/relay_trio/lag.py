"""The lag gauges: how far behind each listener is, refreshed about once a second.

``relay_oldest_pending_age_seconds{listener}`` is the age of the listener's oldest pending
outbox row (0 when it has none): the number an operator alerts on. Labels are exactly the
registered listeners (bounded by the registry); a deleted listener's label is removed.
The query is one index probe per listener, so it stays cheap with a large backlog.
"""

from __future__ import annotations

import logging

import trio

from relay_trio.db import DatabaseUnavailable
from relay_trio.store.ops import oldest_pending_by_listener

log = logging.getLogger("relay_trio.lag")

REFRESH_SECONDS = 1.0


async def refresh_lag(pod, published: set[str]) -> dict[str, float]:
    """Read every listener's oldest pending age and publish it; ``published`` (the label
    values set so far) is updated so deleted listeners' labels are removed."""
    ages = await pod.db.run(oldest_pending_by_listener)
    gauge = pod.metrics.pending_age
    for name, age in ages.items():
        gauge.labels(listener=name).set(age)
    for gone in published - set(ages):
        gauge.remove(gone)
    published.clear()
    published.update(ages)
    return ages


async def lag_component(pod, *, task_status=trio.TASK_STATUS_IGNORED, interval: float = REFRESH_SECONDS) -> None:
    """Refresh the lag gauges forever; a database outage only pauses them (and is logged once)."""
    task_status.started()
    failing = False
    published: set[str] = set()
    while True:
        try:
            await refresh_lag(pod, published)
            if failing:
                log.info("lag gauges refreshing again")
            failing = False
        except DatabaseUnavailable as exc:
            if not failing:
                log.warning("cannot refresh lag gauges: %s", exc)
            failing = True
        await trio.sleep(interval)
