"""The root nursery: one pod's supervision tree.

    run_pod
    └── open_asyncio_loop (trio-asyncio, log-only handler, timer compactor)
        └── root nursery
            ├── pglistener   LISTEN/NOTIFY on a dedicated connection (wakes)
            ├── notifier     coalesced outbox NOTIFY after commit
            ├── registry     listener registry cache (NOTIFY + periodic refresh)
            ├── delivery     run_delivery_loop (hand-off, notify and poll wakes)
            ├── janitor      retention sweeps under the 'janitor' leased lock
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
    """The background components, in start order. Feature modules add theirs here."""
    from relay_trio.pglistener import pglistener_component

    found: list[tuple[str, Component]] = [("pglistener", pglistener_component)]
    from relay_trio.notifier import notifier_component; found.append(("notifier", notifier_component))  # noqa: E702
    from relay_trio.registry import registry_component; found.append(("registry", registry_component))  # noqa: E702
    return found


async def run_http(pod: Pod, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    config = HypercornConfig()
    config.bind = [pod.settings.bind]
    config.graceful_timeout = max(pod.settings.shutdown_grace, 0.1)
    config.keep_alive_timeout = 5
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    app = create_app(pod)
    await hypercorn_serve(app, config, shutdown_trigger=pod.shutting_down.wait, task_status=task_status)


async def run_pod(settings: Settings, dsn: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run one pod until ``pod.shutting_down`` is set, then shut down gracefully."""
    async with open_asyncio_loop():
        db = await Database.connect(
            dsn,
            min_size=settings.pool_min_size,
            max_size=settings.pool_max_size,
            op_timeout=settings.db_timeout,
            acquire_timeout=settings.pool_acquire_timeout,
            application_name=f"relay:{settings.pod_id}"[:63],
        )
        try:
            await db.run(migrate_conn, timeout=120)
            pod = Pod.create(settings, db)
            async with trio.open_nursery() as root:
                for name, component in components(pod):
                    await root.start(supervise, name, component, pod)
                pod.bound_urls = await root.start(run_http, pod)
                log.info("relay pod %s serving on %s", pod.pod_id, ", ".join(pod.bound_urls))
                task_status.started(pod)
                await pod.shutting_down.wait()
                await graceful_shutdown(pod)
                root.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await db.close()


async def graceful_shutdown(pod: Pod) -> None:
    """Stop claiming, let in-flight deliveries finish within the grace, release leases."""
    stop = getattr(pod.delivery, "shutdown", None)
    if stop is not None:
        with trio.move_on_after(pod.settings.shutdown_grace + 1):
            await stop(pod.settings.shutdown_grace)
