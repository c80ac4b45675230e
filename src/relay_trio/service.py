"""The root nursery: one pod's supervision tree.

    run_pod
    └── open_asyncio_loop (trio-asyncio, log-only handler, timer compactor)
        └── root nursery
            ├── pglistener   LISTEN/NOTIFY on a dedicated connection (wakes)
            ├── notifier     coalesced outbox NOTIFY after commit
            ├── registry     listener registry cache (NOTIFY + periodic refresh)
            ├── delivery     run_delivery_loop (hand-off, notify and poll wakes)
            ├── janitor      retention sweeps under the 'janitor' leased lock
            ├── lag          per-listener oldest-pending gauges for /metrics
            └── http         hypercorn serving the quart-trio app

Each component is an ``async def component(pod, *, task_status)`` that calls
``task_status.started()`` once it is ready. ``supervise`` restarts a component that
crashes (with backoff) so one bug cannot take down intake; the crash is logged and shows
in /readyz while the component is down.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from relay_trio.config import Settings
from relay_trio.db import Database, open_asyncio_loop
from relay_trio.migrations import migrate_conn
from relay_trio.runtime import Pod
from relay_trio.web import keepalive_fix
from relay_trio.web.app import create_app

log = logging.getLogger("relay_trio.service")

Component = Callable[..., Awaitable[Any]]


async def supervise(name: str, component: Component, pod: Pod, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run ``component(pod)`` forever: restart it with backoff when it crashes."""
    delay = 0.1
    first = True
    while True:
        pod.tasks_alive[name] = False
        try:
            if first:
                # The first start is awaited by the root so the pod is only ready when
                # every component is.
                async with trio.open_nursery() as inner:
                    await inner.start(component, pod)
                    pod.tasks_alive[name] = True
                    task_status.started()
                    first = False
            else:
                async with trio.open_nursery() as inner:
                    await inner.start(component, pod)
                    pod.tasks_alive[name] = True
            log.warning("component %s returned; restarting", name)
        except Exception:
            log.exception("component %s crashed; restarting in %.1fs", name, delay)
        pod.tasks_alive[name] = False
        if first:
            # It never started: report readiness anyway (it shows as down in /readyz).
            task_status.started()
            first = False
        await trio.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 5.0)


def components(pod: Pod) -> list[tuple[str, Component]]:
    """The background components, in start order.

    The listener starts first so every later component can subscribe to it; the delivery
    loop starts after the notifier and registry it relies on. Imported here, not at module
    level, because each component module imports the Pod type from this package.
    """
    from relay_trio.delivery.loop import delivery_component
    from relay_trio.janitor import janitor_component
    from relay_trio.lag import lag_component
    from relay_trio.notifier import notifier_component
    from relay_trio.pglistener import pglistener_component
    from relay_trio.registry import registry_component

    return [
        ("pglistener", pglistener_component),
        ("notifier", notifier_component),
        ("registry", registry_component),
        ("delivery", delivery_component),
        ("janitor", janitor_component),
        ("lag", lag_component),
    ]


def http_drain_timeout(settings: Settings) -> float:
    """How long in-flight HTTP requests get once shutdown starts.

    Requests are short (every handler is bounded by the database deadline); the delivery
    grace is a separate budget that starts after the HTTP drain.
    """
    return max(min(settings.shutdown_grace, settings.db_timeout + 1.0), 0.1)


async def run_http(pod: Pod, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the API until ``pod.shutting_down`` is set, then drain and return.

    On the trigger hypercorn closes the listening sockets at once (new connections are
    refused), lets in-flight requests finish within the drain timeout, and closes idle
    keep-alive connections right away. The last part needs ``keepalive_fix``: without it
    an idle keep-alive connection holds the drain for the whole graceful timeout.
    """
    keepalive_fix.install()
    config = HypercornConfig()
    config.bind = [pod.settings.bind]
    config.graceful_timeout = http_drain_timeout(pod.settings)
    config.keep_alive_timeout = 5
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    app = create_app(pod)
    await hypercorn_serve(app, config, shutdown_trigger=pod.shutting_down.wait, task_status=task_status)


async def _serve_http(pod: Pod, http_done: trio.Event, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    try:
        await run_http(pod, task_status=task_status)
    finally:
        http_done.set()
    if not pod.shutting_down.is_set():
        # A pod that cannot serve HTTP is of no use: shut the rest down too.
        log.error("HTTP server stopped unexpectedly; shutting the pod down")
        pod.shutting_down.set()


async def run_pod(settings: Settings, dsn: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run one pod until ``pod.shutting_down`` is set, then shut down gracefully.

    Shutdown order (see ``graceful_shutdown``): HTTP stops accepting and drains; delivery
    stops claiming and gets the grace; the remaining components (listener, notifier, ...)
    are cancelled; every lease this pod still holds is released; the pool is closed.
    """
    async with open_asyncio_loop():
        db = await Database.connect(
            dsn,
            min_size=settings.pool_min_size,
            max_size=settings.pool_max_size,
            op_timeout=settings.db_timeout,
            acquire_timeout=settings.pool_acquire_timeout,
            application_name=f"relay:{settings.pod_id}"[:63],
        )
        pod: Pod | None = None
        woken = False
        try:
            await db.run(migrate_conn, timeout=120)
            pod = Pod.create(settings, db)
            async with trio.open_nursery() as root:
                for name, component in components(pod):
                    await root.start(supervise, name, component, pod)
                http_done = trio.Event()
                pod.bound_urls = await root.start(_serve_http, pod, http_done)
                log.info("relay pod %s serving on %s", pod.pod_id, ", ".join(pod.bound_urls))
                task_status.started(pod)
                await pod.shutting_down.wait()
                log.info("graceful shutdown started")
                woken = await graceful_shutdown(pod, http_done)
                root.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                if pod is not None:
                    await release_own_leases(pod, wake=not woken)
                await db.close()
            if pod is not None and pod.shutting_down.is_set():
                log.info("graceful shutdown finished")


async def graceful_shutdown(pod: Pod, http_done: trio.Event | None = None) -> bool:
    """The ordered part of a graceful shutdown, run while every component is still up.

    1. HTTP: the trigger (``pod.shutting_down``) already closed the listening sockets;
       wait for in-flight requests to finish (bounded by the drain timeout).
    2. Delivery: stop claiming, give in-flight deliveries up to ``shutdown_grace``, cancel
       the rest and release their leases (``pod.delivery.shutdown``).
    3. When delivery stopped cleanly: release any lease left and wake the other pods now
       (the listener is still up), so they claim the released rows and any hand-off this
       pod never claimed at once. Returns whether that wake was sent.
    The caller then cancels the remaining components and runs the lease release again as
    a safety net (after every delivery task is gone).
    """
    if http_done is not None:
        with trio.move_on_after(http_drain_timeout(pod.settings) + 1.0):
            await http_done.wait()
    stop = getattr(pod.delivery, "shutdown", None)
    if stop is not None:
        with trio.move_on_after(pod.settings.shutdown_grace + 1) as cs:
            try:
                await stop(pod.settings.shutdown_grace)
            except Exception:
                log.exception("delivery shutdown failed; leases are released after cancelling it")
                return False
        if cs.cancelled_caught:
            log.warning("delivery shutdown exceeded the grace; cancelling it")
            return False
    return await release_own_leases(pod, wake=True)


async def release_own_leases(pod: Pod, *, wake: bool) -> bool:
    """Release every lease this pod still holds; NOTIFY the outbox channel when ``wake``
    or when anything was released. Returns whether the database took it.

    Normally ``pod.delivery.shutdown`` released them already; this catches deliveries
    cancelled by a crash or an overrun grace, so another pod claims those rows at once
    instead of after the lease expires. Only call it when no delivery task of this pod
    can still complete a row.
    """
    from relay_trio.db import DatabaseUnavailable
    from relay_trio.store.ops import release_pod_leases

    with trio.move_on_after(3.0):
        try:
            released = await pod.db.run_tx(release_pod_leases, pod.pod_id, wake, timeout=2.5)
        except DatabaseUnavailable as exc:
            log.warning("could not release this pod's leases: %s", exc)
            return False
        if released:
            log.info("released %d leases left at shutdown", released, extra={"released": released})
        return True
    return False
