"""Shared fixtures: one real PostgreSQL per test session, one fresh database per test.

The session cluster is the project's own embedded cluster (tuned for tests: fsync off,
in a temp dir), started by the same helper ``relay-trio serve`` uses. Set
RELAY_TEST_DATABASE_URL to run against an existing server instead. If the embedded
cluster cannot start, the machine's PostgreSQL on 127.0.0.1:5432 is used when reachable.

Every test gets its own database cloned from a migrated template, so tests never see
each other's rows.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import urllib.parse
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

warnings.filterwarnings("ignore", message=".*AbstractChildWatcher.*", category=DeprecationWarning)

from relay_trio.config import Settings  # noqa: E402
from relay_trio.db import Database, admin_execute_sync, admin_fetchval_sync, open_asyncio_loop, quote_ident  # noqa: E402

FALLBACK_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def dsn_with_db(dsn: str, dbname: str) -> str:
    parts = urllib.parse.urlsplit(dsn)
    return urllib.parse.urlunsplit(parts._replace(path="/" + dbname))


class PgServer:
    """A PostgreSQL server the suite may create databases on."""

    def __init__(self, admin_dsn: str, cluster=None):
        self.admin_dsn = admin_dsn
        self.cluster = cluster  # EmbeddedPostgres when the suite started its own

    def dsn(self, dbname: str) -> str:
        return dsn_with_db(self.admin_dsn, dbname)

    def create_database(self, name: str, template: str | None = None) -> str:
        stmt = f"CREATE DATABASE {quote_ident(name)}"
        if template:
            stmt += f" TEMPLATE {quote_ident(template)}"
        admin_execute_sync(self.admin_dsn, stmt)
        return self.dsn(name)

    def drop_database(self, name: str) -> None:
        admin_execute_sync(self.admin_dsn, f"DROP DATABASE IF EXISTS {quote_ident(name)} WITH (FORCE)")


def _reachable(dsn: str) -> bool:
    try:
        return admin_fetchval_sync(dsn, "SELECT 1") == 1
    except Exception:
        return False


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    url = os.environ.get("RELAY_TEST_DATABASE_URL")
    if url:
        yield PgServer(url)
        return
    from relay_trio.embedded_pg import EmbeddedPostgres, EmbeddedPostgresError

    tmp = Path(tempfile.mkdtemp(prefix="relay-test-pg-"))
    cluster = None
    try:
        cluster = EmbeddedPostgres(tmp / "data", for_tests=True)
        cluster.start()
    except EmbeddedPostgresError as exc:
        if _reachable(FALLBACK_URL):
            warnings.warn(f"embedded test cluster failed ({exc}); using {FALLBACK_URL}")
            cluster = None
        else:
            pytest.exit(f"no PostgreSQL for the test suite: {exc}", returncode=3)
    try:
        yield PgServer(cluster.dsn("postgres") if cluster else FALLBACK_URL, cluster)
    finally:
        if cluster is not None:
            cluster.stop("immediate")
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def template_db(pg_server: PgServer) -> Iterator[str]:
    """A migrated database every test database is cloned from."""
    from relay_trio.migrations import migrate_conn

    name = f"relay_tpl_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    dsn = pg_server.create_database(name)

    async def migrate() -> None:
        import asyncpg

        conn = await asyncpg.connect(dsn)
        try:
            await migrate_conn(conn)
        finally:
            await conn.close()

    asyncio.run(migrate())
    yield name
    pg_server.drop_database(name)


@pytest.fixture
def database_url(pg_server: PgServer, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for one test."""
    name = f"relay_t_{uuid.uuid4().hex[:12]}"
    dsn = pg_server.create_database(name, template=template_db)
    yield dsn
    pg_server.drop_database(name)


@pytest.fixture
def empty_database_url(pg_server: PgServer) -> Iterator[str]:
    """A fresh database with no schema at all (migration tests)."""
    name = f"relay_e_{uuid.uuid4().hex[:12]}"
    dsn = pg_server.create_database(name)
    yield dsn
    pg_server.drop_database(name)


@pytest.fixture
def cluster_dir() -> Iterator[Path]:
    """A scratch directory for a dedicated EmbeddedPostgres cluster.

    Not under pytest's tmp_path: pytest resets /tmp/pytest-of-<user> to mode 0700 at every
    session start, which would lock the unprivileged server user (when root) out of a
    cluster that lives below it while another pytest session starts.
    """
    path = Path(tempfile.mkdtemp(prefix="relay-cluster-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def aio_loop() -> AsyncIterator[asyncio.AbstractEventLoop]:
    async with open_asyncio_loop() as loop:
        yield loop


@pytest.fixture
async def db(aio_loop, database_url: str) -> AsyncIterator[Database]:
    database = await Database.connect(database_url, min_size=1, max_size=10)
    try:
        yield database
    finally:
        await database.close()


def make_settings(database_url: str, **overrides) -> Settings:
    """Settings for a pod under test: loopback, port 0, no embedded cluster."""
    base = dict(database_url=database_url, bind="127.0.0.1:0", log_format="console", shutdown_grace=2.0)
    base.update(overrides)
    return Settings(**base)


@pytest.fixture
def settings_factory(database_url: str):
    def factory(**overrides) -> Settings:
        return make_settings(database_url, **overrides)

    return factory


@pytest.fixture
async def pod_factory(nursery: trio.Nursery, database_url: str):
    """Start pods (run_pod) in the test's nursery; each returns its Pod once serving.

    Note: run_pod opens its own trio-asyncio loop; pods here share the test's loop
    because open_asyncio_loop nests by reusing the running loop.
    """
    from relay_trio.service import run_pod

    started = []

    async def factory(**overrides):
        settings = make_settings(database_url, **overrides)
        pod = await nursery.start(run_pod, settings, settings.database_url)
        started.append(pod)
        return pod

    yield factory
    for pod in started:
        pod.shutting_down.set()
