"""The one place where trio meets asyncio (and asyncpg).

Rules this module enforces for the rest of the code base:

* The trio-asyncio loop is opened once, at the root (``open_asyncio_loop``), with a
  log-only exception handler: an exception raised by an asyncio callback (an asyncpg
  listener callback, say) is logged, never allowed to take the loop down.
* A logical database operation is an *asyncio-side* coroutine function
  ``async def op(conn, *args)``; ``Database.run`` / ``Database.run_tx`` cross from trio
  once per operation (acquire, every statement, commit), never once per statement.
* Work is bounded with trio cancel scopes, never with asyncpg ``timeout=`` arguments:
  trio-asyncio 0.16 keeps cancelled asyncio timers in its heap until their deadline, so
  every asyncpg timeout would leak a timer. The pool is created with
  ``max_inactive_connection_lifetime=0`` for the same reason, and a compactor task drops
  cancelled timers from the heap the way stdlib asyncio does.
* Connection loss in any of its asyncpg shapes becomes ``DatabaseUnavailable``.
* An operation marked ``@leaves_no_session_state`` (the hot paths: intake, claims, the
  success settle) promises that no SET, LISTEN, cursor or advisory lock outlives it when
  it returns normally: the pool then skips its reset round trip on release (see
  ``_reset_connection``). Any other operation, and any failed or cancelled one, gets
  asyncpg's full reset.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import logging
import socket
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

with warnings.catch_warnings():
    # Python 3.12+: trio_asyncio subclasses the deprecated AbstractChildWatcher.
    warnings.filterwarnings("ignore", message=".*AbstractChildWatcher.*", category=DeprecationWarning)
    import trio_asyncio

import asyncpg
import asyncpg.exceptions
import trio
from trio_asyncio import aio_as_trio

log = logging.getLogger("relay_trio.db")

T = TypeVar("T")
Op = Callable[..., Awaitable[T]]

# Everything asyncpg (or the socket under it) raises when the server went away.
CONNECTION_LOST_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,  # admin shutdown, cannot connect now
    asyncpg.exceptions.TooManyConnectionsError,
    OSError,
    ConnectionError,
    EOFError,
)


class DatabaseUnavailable(Exception):
    """The database cannot be reached (connection lost, refused, shutting down)."""


class DatabaseTimeout(DatabaseUnavailable):
    """A database operation did not finish within its deadline."""


class PoolExhausted(DatabaseUnavailable):
    """No pooled connection became free within the acquire deadline."""


class DatabaseConflict(DatabaseUnavailable):
    """The transaction was rolled back by a deadlock or serialization failure: retry it."""


# How long a cancelled operation may take to unwind cleanly before its connection is
# terminated. asyncpg's clean-up after a cancel (ROLLBACK, pool reset) waits for the
# server with no deadline of its own; a frozen backend or a silent network would hang it.
CANCEL_GRACE = 0.5


def enable_tcp_keepalive(conn: Any) -> bool:
    """Client TCP keepalive (idle 1 s, interval 1 s, 3 probes) on the connection's socket.

    asyncpg has no keepalive option, so this goes through the transport's socket. A unix
    socket is skipped (returns False): there is no network to drop packets.
    """
    transport = getattr(conn, "_transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        opt = getattr(socket, name, None)
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)
    return True


def is_connection_lost(exc: BaseException) -> bool:
    return isinstance(exc, CONNECTION_LOST_ERRORS)


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------
def _log_only_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    exc = context.get("exception")
    log.error(
        "asyncio callback failed: %s",
        context.get("message", "unknown"),
        exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None,
    )


def timer_heap(loop: asyncio.AbstractEventLoop | None = None) -> list[asyncio.TimerHandle]:
    loop = loop or asyncio.get_event_loop()
    return loop._timers  # type: ignore[attr-defined]


def compact_timer_heap(loop: asyncio.AbstractEventLoop, *, min_size: int = 64) -> int:
    """Drop cancelled timers from trio-asyncio's heap; return how many were dropped.

    stdlib asyncio compacts when more than half the scheduled timers are cancelled;
    trio-asyncio 0.16 never does. The heap is only touched synchronously by the loop's
    own task, so rebuilding it between two of its steps is safe.
    """
    timers = timer_heap(loop)
    if len(timers) < min_size:
        return 0
    live = [t for t in timers if not t.cancelled()]
    dropped = len(timers) - len(live)
    if dropped * 2 > len(timers):
        heapq.heapify(live)
        timers[:] = live
        return dropped
    return 0


async def _compact_forever(loop: asyncio.AbstractEventLoop, interval: float) -> None:
    while True:
        await trio.sleep(interval)
        compact_timer_heap(loop)


@asynccontextmanager
async def open_asyncio_loop(compact_interval: float = 0.5) -> AsyncIterator[asyncio.AbstractEventLoop]:
    """Open the trio-asyncio loop for the whole service (or one test)."""
    async with trio_asyncio.open_loop() as loop:
        loop.set_exception_handler(_log_only_exception_handler)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_compact_forever, loop, compact_interval)
            try:
                yield loop
            finally:
                nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------------------
# The pool
# --------------------------------------------------------------------------------------
class Database:
    """A pool of asyncpg connections, used from trio.

    ``run(op, *args)`` runs ``op(conn, *args)`` on a pooled connection in one crossing;
    ``run_tx`` does the same inside a transaction, which commits when ``op`` returns and
    rolls back when it raises. The transaction handle is the connection itself: store
    functions named ``*_tx`` take it as their first argument so a caller composes several
    of them into one transaction and one crossing.
    """

    def __init__(self, pool: asyncpg.Pool, dsn: str, *, op_timeout: float, acquire_timeout: float):
        self.pool = pool
        self.dsn = dsn
        self.op_timeout = op_timeout
        self.acquire_timeout = acquire_timeout
        # In-flight operations: id -> (their cancel scope, the connection once acquired).
        self._inflight: dict[int, tuple[trio.CancelScope, list[asyncpg.Connection]]] = {}
        self._watchdog_scope = trio.CancelScope()
        self.terminated_by_watchdog = 0
        trio.lowlevel.spawn_system_task(self._watchdog, name="relay-db-watchdog")

    async def _watchdog(self) -> None:
        """Terminate the connection of an operation stuck past its deadline.

        A trio deadline cancels the asyncio task, but asyncpg then waits for the server to
        acknowledge (ROLLBACK, reset) without a deadline: against a frozen backend the
        crossing would never return. Past ``deadline + CANCEL_GRACE`` the connection is
        terminated, which ends the clean-up at once; the pool replaces the connection.
        One task per pool polling a small dict keeps the per-operation cost at zero.
        """
        with self._watchdog_scope:
            while True:
                await trio.sleep(0.1)
                now = trio.current_time()
                for scope, held in list(self._inflight.values()):
                    if held and now > scope.deadline + CANCEL_GRACE:
                        conn = held.pop()
                        self.terminated_by_watchdog += 1
                        log.warning("database operation stuck %.1fs past its deadline: terminating its connection",
                                    now - scope.deadline)
                        try:
                            conn.terminate()
                        except Exception:  # noqa: BLE001 - best effort; the pool drops it anyway
                            log.exception("terminating a stuck connection failed")

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        min_size: int = 2,
        max_size: int = 10,
        op_timeout: float = 5.0,
        acquire_timeout: float = 2.0,
        application_name: str = "relay-trio",
    ) -> Database:
        async def create() -> asyncpg.Pool:
            return await asyncpg.create_pool(
                dsn,
                min_size=min_size,
                max_size=max_size,
                max_inactive_connection_lifetime=0,  # no per-release timer (trio-asyncio leak)
                server_settings={"application_name": application_name},
                init=_init_connection,
                reset=_reset_connection,
            )

        try:
            with trio.fail_after(op_timeout + acquire_timeout):
                pool = await aio_as_trio(create)()
        except trio.TooSlowError as exc:
            raise DatabaseTimeout(f"connecting to the database took over {op_timeout + acquire_timeout:.1f}s") from exc
        except CONNECTION_LOST_ERRORS as exc:
            raise DatabaseUnavailable(f"cannot connect to the database: {exc}") from exc
        return cls(pool, dsn, op_timeout=op_timeout, acquire_timeout=acquire_timeout)

    async def close(self) -> None:
        self._watchdog_scope.cancel()
        with trio.move_on_after(5) as cs:
            await aio_as_trio(self.pool.close)()
        if cs.cancelled_caught:
            self.pool.terminate()

    async def run(self, op: Op[T], *args: Any, timeout: float | None = None, tx: bool = False) -> T:
        """Run ``op(conn, *args)`` on a pooled connection: one trio->asyncio crossing.

        The acquire has its own (shorter) deadline so a saturated pool answers quickly
        (``PoolExhausted``); once acquired, the operation gets ``timeout`` seconds.
        """
        op_timeout = self.op_timeout if timeout is None else timeout
        scope = trio.CancelScope(deadline=trio.current_time() + self.acquire_timeout)
        acquired = False
        held: list[asyncpg.Connection] = []

        async def body() -> T:
            nonlocal acquired
            async with self.pool.acquire() as conn:
                acquired = True
                held.append(conn)
                # Same thread, inside trio: moving the trio deadline from here is safe.
                scope.deadline = trio.current_time() + op_timeout
                if tx:
                    async with conn.transaction():
                        result = await op(conn, *args)
                else:
                    result = await op(conn, *args)
                # Reached only when the operation (and its COMMIT) finished normally: the
                # release below may skip the reset query (read in this same asyncio task).
                if getattr(op, "leaves_no_session_state", False) and not conn.is_in_transaction():
                    _finished_clean.set(True)
                return result

        result: T
        key = id(scope)
        self._inflight[key] = (scope, held)
        try:
            with scope:
                result = await aio_as_trio(body)()
        except CONNECTION_LOST_ERRORS as exc:
            if scope.cancelled_caught or scope.cancel_called:
                raise DatabaseTimeout(f"database operation exceeded {op_timeout:.1f}s (connection terminated)") from exc
            raise DatabaseUnavailable(f"database connection lost: {type(exc).__name__}: {exc}") from exc
        except asyncpg.TransactionRollbackError as exc:
            raise DatabaseConflict(f"transaction rolled back: {type(exc).__name__}: {exc}") from exc
        finally:
            del self._inflight[key]
        if scope.cancelled_caught:
            if not acquired:
                raise PoolExhausted(f"no database connection free within {self.acquire_timeout:.1f}s")
            raise DatabaseTimeout(f"database operation exceeded {op_timeout:.1f}s")
        return result

    async def run_tx(self, op: Op[T], *args: Any, timeout: float | None = None) -> T:
        return await self.run(op, *args, timeout=timeout, tx=True)

    async def ping(self, timeout: float = 2.0) -> bool:
        async def select_one(conn: asyncpg.Connection) -> Any:
            return await conn.fetchval("SELECT 1")

        try:
            return await self.run(select_one, timeout=timeout) == 1
        except DatabaseUnavailable:
            return False


def leaves_no_session_state(op: Op[T]) -> Op[T]:
    """Mark an operation whose normal return leaves the session as it found it (no SET,
    LISTEN, cursor or session advisory lock): its connection goes back to the pool without
    the reset round trip. Only for single statements / transactions that are plainly so."""
    op.leaves_no_session_state = True  # type: ignore[attr-defined]
    return op


# True once the current asyncio task's marked operation finished normally (set in
# Database.run's body, read by _reset_connection while the same task releases the connection).
_finished_clean: contextvars.ContextVar[bool] = contextvars.ContextVar("relay_db_finished_clean", default=False)


async def _reset_connection(conn: asyncpg.Connection) -> None:
    """The pool's reset on release, minus the round trip when nothing needs resetting.

    asyncpg's default runs ``SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *;
    RESET ALL`` on every release: one more server round trip (and trio<->asyncio wake-up)
    per operation, i.e. half of a delivery's claim+settle and a fifth of an intake.
    Operations marked ``@leaves_no_session_state`` keep no session state once they return
    normally, so after them that query is skipped; it still runs after any other operation
    and after a failure or cancellation, which may have left, say, the event trigger's
    advisory lock held. asyncpg has already rolled back any open transaction and dropped
    callbacks before calling this, in every case.
    """
    if _finished_clean.get():
        _finished_clean.set(False)
        return
    query = conn.get_reset_query()
    if query:
        await conn.execute(query)


async def _init_connection(conn: asyncpg.Connection) -> None:
    """Every pooled connection: client TCP keepalive (a silent network fails in ~4 s)."""
    enable_tcp_keepalive(conn)


# --------------------------------------------------------------------------------------
# A dedicated connection (outside the pool), for the LISTEN/NOTIFY listener
# --------------------------------------------------------------------------------------
async def connect_dedicated(dsn: str, application_name: str, timeout: float = 5.0) -> asyncpg.Connection:
    """Open one asyncpg connection outside any pool (LISTEN does not survive a pool release)."""

    async def connect() -> asyncpg.Connection:
        return await asyncpg.connect(dsn, server_settings={"application_name": application_name})

    try:
        with trio.fail_after(timeout):
            return await aio_as_trio(connect)()
    except trio.TooSlowError as exc:
        raise DatabaseTimeout(f"connecting took over {timeout:.1f}s") from exc
    except CONNECTION_LOST_ERRORS as exc:
        raise DatabaseUnavailable(f"cannot connect: {type(exc).__name__}: {exc}") from exc


async def on_connection(conn: asyncpg.Connection, op: Op[T], *args: Any, timeout: float = 5.0) -> T:
    """Run ``op(conn, *args)`` on a dedicated connection: one crossing, trio deadline."""
    try:
        with trio.fail_after(timeout):
            return await aio_as_trio(op)(conn, *args)
    except trio.TooSlowError as exc:
        raise DatabaseTimeout(f"operation exceeded {timeout:.1f}s") from exc
    except CONNECTION_LOST_ERRORS as exc:
        raise DatabaseUnavailable(f"connection lost: {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------------------
# Synchronous admin helpers (test fixtures, the embedded cluster's bootstrap)
# --------------------------------------------------------------------------------------
def admin_execute_sync(dsn: str, *statements: str) -> None:
    """Run statements outside any trio loop (plain asyncio.run): for setup code only."""

    async def main() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            for statement in statements:
                await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(main())


def admin_fetchval_sync(dsn: str, query: str, *args: Any) -> Any:
    async def main() -> Any:
        conn = await asyncpg.connect(dsn)
        try:
            return await conn.fetchval(query, *args)
        finally:
            await conn.close()

    return asyncio.run(main())


def quote_ident(name: str) -> str:
    """Quote an SQL identifier (channel and database names)."""
    if "\x00" in name:
        raise ValueError("identifier contains NUL")
    return '"' + name.replace('"', '""') + '"'
