"""Schema migrations: idempotent, serialized by an advisory lock, append-only."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import trio

from relay_trio.db import Database
from relay_trio.migrations import Migration, MigrationError, load_migrations, migrate_conn, pending_migrations_tx

EXPECTED_TABLES = {
    "events",
    "listeners",
    "deliveries",
    "delivery_attempts",
    "consumer_offsets",
    "locks",
    "relay_schema_migrations",
}


async def tables(conn) -> set[str]:
    rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    return {r["tablename"] for r in rows}


async def test_fresh_database_ends_with_the_expected_tables(aio_loop, empty_database_url):
    db = await Database.connect(empty_database_url, min_size=1, max_size=2)
    try:
        assert len(await db.run(pending_migrations_tx)) == len(load_migrations())
        applied = await db.run(migrate_conn)
        assert applied == [m.version for m in load_migrations()]
        assert EXPECTED_TABLES <= await db.run(tables)
        assert await db.run(pending_migrations_tx) == []
    finally:
        await db.close()


async def test_applying_twice_is_a_no_op(aio_loop, empty_database_url):
    db = await Database.connect(empty_database_url, min_size=1, max_size=2)
    try:
        await db.run(migrate_conn)

        async def snapshot(conn):
            return await conn.fetch("SELECT version, checksum, applied_at FROM relay_schema_migrations ORDER BY 1")

        before = await db.run(snapshot)
        assert await db.run(migrate_conn) == []
        assert await db.run(snapshot) == before
    finally:
        await db.close()


async def test_concurrent_migrators_do_not_collide(aio_loop, empty_database_url):
    dbs = [await Database.connect(empty_database_url, min_size=1, max_size=1) for _ in range(4)]
    results: list[list[int]] = []
    try:
        async with trio.open_nursery() as nursery:
            for db in dbs:

                async def one(db=db):
                    results.append(await db.run(migrate_conn, timeout=60))

                nursery.start_soon(one)
        everything = [m.version for m in load_migrations()]
        applied = sorted(v for r in results for v in r)
        assert applied == everything, f"each migration applied exactly once, got {results}"
        assert EXPECTED_TABLES <= await dbs[0].run(tables)
    finally:
        for db in dbs:
            await db.close()


async def test_a_changed_applied_migration_is_refused(aio_loop, empty_database_url, monkeypatch):
    db = await Database.connect(empty_database_url, min_size=1, max_size=1)
    try:
        await db.run(migrate_conn)
        original = load_migrations()
        tampered = [Migration(m.version, m.name, m.sql + "\n-- edited") for m in original]
        monkeypatch.setattr("relay_trio.migrations.load_migrations", lambda: tampered)
        with pytest.raises(MigrationError, match="changed after it was applied"):
            await db.run(migrate_conn)
    finally:
        await db.close()


def test_migration_files_are_numbered_and_unique():
    migrations = load_migrations()
    assert migrations, "no migration files packaged"
    versions = [m.version for m in migrations]
    assert versions == sorted(set(versions))
    assert versions[0] == 1


def test_migrate_command_applies_without_serving(empty_database_url):
    env = {**os.environ, "RELAY_DATABASE_URL": empty_database_url, "RELAY_LOG_FORMAT": "console"}
    first = subprocess.run([sys.executable, "-m", "relay_trio", "migrate"], env=env, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert "applied" in first.stdout
    second = subprocess.run([sys.executable, "-m", "relay_trio", "migrate"], env=env, capture_output=True, text=True, timeout=60)
    assert second.returncode == 0, second.stderr
    assert "up to date" in second.stdout
