"""Leased locks on a real PostgreSQL: one winner, owner-only renew, expiry, fencing."""

from __future__ import annotations

import trio

from relay_trio.store.locks import Lease, acquire_lock, release_lock, renew_lock


async def test_two_contenders_one_wins(db):
    results: list[Lease | None] = []

    async def contend(owner: str) -> None:
        results.append(await db.run(acquire_lock, "job", 30.0, owner))

    async with trio.open_nursery() as n:
        for owner in ("pod-a", "pod-b", "pod-c"):
            n.start_soon(contend, owner)
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    assert winners[0].name == "job" and winners[0].token > 0


async def test_renew_only_by_the_holder(db):
    lease = await db.run(acquire_lock, "job", 30.0, "pod-a")
    assert lease is not None
    assert await db.run(acquire_lock, "job", 30.0, "pod-b") is None
    # The loser forging a lease with its own name cannot renew.
    forged = Lease(name="job", owner="pod-b", token=lease.token, expires_at=lease.expires_at)
    assert await db.run(renew_lock, forged, 30.0) is None
    renewed = await db.run(renew_lock, lease, 60.0)
    assert renewed is not None
    assert renewed.token == lease.token
    assert renewed.expires_at > lease.expires_at


async def test_expired_lease_can_be_taken_and_stale_token_cannot_renew(db):
    first = await db.run(acquire_lock, "job", 0.2, "pod-a")
    assert first is not None
    assert await db.run(acquire_lock, "job", 30.0, "pod-b") is None
    await trio.sleep(0.5)  # real time: expiry is judged by the database clock
    second = await db.run(acquire_lock, "job", 30.0, "pod-b")
    assert second is not None
    assert second.owner == "pod-b"
    assert second.token > first.token
    # pod-a's lease is stale: it cannot renew or release pod-b's lock.
    assert await db.run(renew_lock, first, 30.0) is None
    assert await db.run(release_lock, first) is False
    # Same owner name again with the old token (a restarted pod with the same id): still refused.
    stale = Lease(name="job", owner="pod-b", token=first.token, expires_at=first.expires_at)
    assert await db.run(renew_lock, stale, 30.0) is None
    assert await db.run(renew_lock, second, 30.0) is not None


async def test_expired_lease_cannot_be_renewed(db):
    lease = await db.run(acquire_lock, "job", 0.2, "pod-a")
    assert lease is not None
    await trio.sleep(0.5)
    assert await db.run(renew_lock, lease, 30.0) is None


async def test_release_then_acquire(db):
    lease = await db.run(acquire_lock, "job", 30.0, "pod-a")
    assert lease is not None
    assert await db.run(release_lock, lease) is True
    assert await db.run(release_lock, lease) is False
    other = await db.run(acquire_lock, "job", 30.0, "pod-b")
    assert other is not None and other.owner == "pod-b"


async def test_locks_are_independent_by_name(db):
    assert await db.run(acquire_lock, "a", 30.0, "pod-a") is not None
    assert await db.run(acquire_lock, "b", 30.0, "pod-b") is not None
