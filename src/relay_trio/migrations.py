"""Schema migrations: ordered plain SQL files applied under an advisory lock.

Files live in ``relay_trio/sql/migrations`` as ``NNNN_name.sql``. Each is applied in its
own transaction and recorded in ``relay_schema_migrations`` with a checksum; an applied
file whose checksum changed is an error (migrations are append-only).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from importlib import resources

import asyncpg

log = logging.getLogger("relay_trio.migrations")

MIGRATION_LOCK_KEY = 72604210000


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


class MigrationError(RuntimeError):
    pass


def load_migrations() -> list[Migration]:
    folder = resources.files("relay_trio") / "sql" / "migrations"
    found = []
    for entry in folder.iterdir():
        if not entry.name.endswith(".sql"):
            continue
        stem = entry.name[:-4]
        number, _, name = stem.partition("_")
        if not number.isdigit():
            raise MigrationError(f"migration file {entry.name} does not start with a number")
        found.append(Migration(int(number), name, entry.read_text()))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"duplicate migration numbers: {versions}")
    return found


async def pending_migrations_tx(conn: asyncpg.Connection) -> list[Migration]:
    """Migrations not yet applied (asyncio side; used by /readyz)."""
    exists = await conn.fetchval("SELECT to_regclass('relay_schema_migrations') IS NOT NULL")
    applied: set[int] = set()
    if exists:
        applied = {r["version"] for r in await conn.fetch("SELECT version FROM relay_schema_migrations")}
    return [m for m in load_migrations() if m.version not in applied]


async def migrate_conn(conn: asyncpg.Connection) -> list[int]:
    """Apply every pending migration (asyncio side). Returns the versions applied now."""
    migrations = load_migrations()
    applied_now: list[int] = []
    await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
    try:
        await conn.execute(
            """
            CREATE TABLE IF NOT EXISTS relay_schema_migrations (
                version     integer PRIMARY KEY,
                name        text NOT NULL,
                checksum    text NOT NULL,
                applied_at  timestamptz NOT NULL DEFAULT now()
            )
            """
        )
        rows = await conn.fetch("SELECT version, checksum FROM relay_schema_migrations")
        done = {r["version"]: r["checksum"] for r in rows}
        for m in migrations:
            if m.version in done:
                if done[m.version] != m.checksum:
                    raise MigrationError(
                        f"migration {m.version:04d}_{m.name} was changed after it was applied"
                    )
                continue
            async with conn.transaction():
                await conn.execute(m.sql)
                await conn.execute(
                    "INSERT INTO relay_schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                    m.version,
                    m.name,
                    m.checksum,
                )
            log.info("applied migration %04d_%s", m.version, m.name)
            applied_now.append(m.version)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
    return applied_now
