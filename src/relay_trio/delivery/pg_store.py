"""The delivery loop's store on PostgreSQL: each method is one ``db.run`` crossing.

The loop only sees this small interface (claim_by_id, claim_due, settle, release), which
tests replace with an in-memory fake to drive the production loop under a fake clock.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence

import asyncpg

from relay_trio.config import Settings
from relay_trio.db import Database
from relay_trio.delivery import model
from relay_trio.delivery.schedule import clamp_retry_after, listener_pause, retry_delay
from relay_trio.store import claims


def row_from_record(rec: asyncpg.Record) -> model.ClaimedRow:
    meta = rec["meta"]
    return model.ClaimedRow(
        id=rec["id"],
        listener=rec["listener"],
        attempt=rec["attempts"],
        token=rec["lease_token"],
        url=rec["url"],
        secret=rec["secret"],
        event={
            "id": rec["event_id"],
            "seq": rec["event_seq"],
            "channel": rec["channel"],
            "author": rec["author"],
            "content": rec["content"],
            "mentions": list(rec["mentions"] or []),
            "meta": json.loads(meta) if isinstance(meta, str) else (meta or {}),
            "accepted_at": rec["accepted_at"],
        },
        age_seconds=float(rec["age_seconds"] or 0.0),
        overdue_seconds=float(rec["overdue_seconds"] or 0.0),
    )


def _text(value: str | None) -> str | None:
    return None if value is None else value.replace("\x00", "\ufffd")


def min_lease(settings) -> float:
    """The shortest lease that outlives one attempt plus its settle transaction."""
    floor = settings.delivery_timeout + settings.pool_acquire_timeout + settings.db_timeout + 1.0
    return max(settings.lease_seconds, floor)


class PgDeliveryStore:
    def __init__(self, db: Database, settings: Settings, pod_id: str):
        self.db = db
        self.settings = settings
        self.pod_id = pod_id
        self.listener_backoff_base = settings.listener_backoff_base

    def _spec(self, limit: int, via: str, budgets: Mapping[str, int], default_budget: int) -> claims.ClaimSpec:
        return claims.ClaimSpec(
            owner=self.pod_id,
            # The lease must outlive one attempt and its settle (no renewal: the attempt is
            # bounded by delivery_timeout, the settle by the pool's acquire deadline plus the
            # operation deadline); short leases stay short so a dead pod's rows return fast.
            lease_seconds=min_lease(self.settings),
            routes=self.settings.route_set,
            limit=limit,
            via=via,
            budgets=dict(budgets),
            default_budget=default_budget,
        )

    async def claim_by_id(
        self, ids: Sequence[int], limit: int, budgets: Mapping[str, int], default_budget: int
    ) -> list[model.ClaimedRow]:
        spec = self._spec(limit, "handoff", budgets, default_budget)
        return [row_from_record(r) for r in await self.db.run(claims.claim_by_id, spec, list(ids))]

    async def claim_due(
        self, limit: int, budgets: Mapping[str, int], default_budget: int, *, via: str = "poll"
    ) -> list[model.ClaimedRow]:
        spec = self._spec(limit, via, budgets, default_budget)
        return [row_from_record(r) for r in await self.db.run(claims.claim_due, spec)]

    def _attempt(self, row: model.ClaimedRow, result: model.AttemptResult) -> claims.AttemptRecord:
        # PostgreSQL text cannot hold NUL: a hostile response body must not make the
        # settlement fail (the row would then wait for its lease instead of its schedule).
        return claims.AttemptRecord(
            delivery_id=row.id,
            attempt=row.attempt,
            pod_id=self.pod_id,
            started_at=result.started_at,
            duration_ms=result.duration_ms,
            outcome=result.outcome,
            status_code=result.status_code,
            error=_text(result.error),
            response_body=_text(result.response_body),
        )

    def retry_delay_for(self, row: model.ClaimedRow, result: model.AttemptResult) -> float:
        s = self.settings
        if result.outcome == model.THROTTLED and result.retry_after is not None:
            return clamp_retry_after(result.retry_after, base=s.retry_base, cap=s.retry_cap)
        return retry_delay(row.attempt, base=s.retry_base, cap=s.retry_cap)

    async def settle(self, row: model.ClaimedRow, result: model.AttemptResult) -> model.Settled:
        attempt = self._attempt(row, result)
        if result.ok:
            # One statement in the usual case (see claims.settle_delivered): no explicit
            # transaction here, the function opens one itself when the listener is dirty.
            age = await self.db.run(claims.settle_delivered, row.id, row.token, row.listener, attempt)
            return model.Settled("stale") if age is None else model.Settled("delivered", float(age))
        if result.outcome == model.GONE:
            await self.db.run_tx(claims.settle_gone_tx, row.id, row.token, row.listener, attempt)
            return model.Settled("dead")
        s = self.settings
        status = await self.db.run_tx(
            functools.partial(
                claims.settle_failed_tx,
                delay=self.retry_delay_for(row, result),
                retention=s.delivery_retention,
                failure_threshold=s.listener_failure_threshold,
                pause_for_level=functools.partial(
                    listener_pause, base=self.listener_backoff_base, cap=s.listener_backoff_cap
                ),
            ),
            row.id, row.token, row.listener, attempt,
        )
        if status is None:
            return model.Settled("stale")
        return model.Settled("dead" if status == "dead" else "retried")

    async def release(self, rows: Sequence[model.ClaimedRow]) -> int:
        return await self.db.run(claims.release_leases, [(r.id, r.token) for r in rows])
