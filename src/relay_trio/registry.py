"""RegistryCache: the enabled listeners this pod routes, kept fresh in memory.

What it is for: the pod's view of which registered, enabled listeners it routes
(``RELAY_ROUTES``), shown to operators in ``/readyz`` (``routed_listeners``). Claims do not
read it: they join ``listeners`` at claim time, so a change of url, secret or enabled
applies to the very next claim on every pod without waiting for any cache. Freshness (the
issue's "every pod's route cache within a second"): every registry write sends
``pg_notify(relay_registry, name)`` in its transaction, each pod's cache reloads on that
wake (well within a second), and a periodic reload (``RELAY_REGISTRY_REFRESH``) is the
safety net for NOTIFYs lost while the LISTEN connection was down. A write on this pod
also pokes its own cache directly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import trio

from relay_trio import channels
from relay_trio.db import DatabaseUnavailable
from relay_trio.store.listeners import CachedListener, load_enabled_listeners

log = logging.getLogger("relay_trio.registry")


class RegistryCache:
    def __init__(self, route_set: frozenset[str] | None):
        self.route_set = route_set  # None = every listener
        self._listeners: dict[str, CachedListener] = {}
        self.loaded = trio.Event()
        self.refreshes = 0
        self.last_refresh: float | None = None  # trio clock
        self._poke = trio.Event()

    # -- reads (sync; the delivery side calls these per claim) --------------------------
    def routes(self, name: str) -> bool:
        """May this pod deliver to ``name`` at all (RELAY_ROUTES)?"""
        return self.route_set is None or name in self.route_set

    def get(self, name: str) -> CachedListener | None:
        """The enabled, routed listener ``name``, or None."""
        return self._listeners.get(name)

    def names(self) -> list[str]:
        return sorted(self._listeners)

    def __contains__(self, name: object) -> bool:
        return name in self._listeners

    def __len__(self) -> int:
        return len(self._listeners)

    # -- updates -------------------------------------------------------------------------
    def replace(self, listeners: Iterable[CachedListener]) -> None:
        self._listeners = {l.name: l for l in listeners if self.routes(l.name)}
        self.refreshes += 1
        self.last_refresh = trio.current_time()
        self.loaded.set()

    def poke(self) -> None:
        """Ask for a reload soon (sync; a registry write on this pod calls it)."""
        self._poke.set()

    async def wait_poke(self) -> None:
        await self._poke.wait()
        self._poke = trio.Event()


async def refresh(pod, cache: RegistryCache) -> bool:
    try:
        listeners = await pod.db.run(load_enabled_listeners)
    except DatabaseUnavailable as exc:
        log.warning("registry refresh failed; keeping the cached registry: %s", exc)
        return False
    cache.replace(listeners)
    return True


async def _forward_wakes(sub, cache: RegistryCache) -> None:
    """Turn registry NOTIFYs (or a reconnect wake, payload None) into pokes."""
    try:
        async for _wake in sub:
            cache.poke()
    except (trio.EndOfChannel, trio.ClosedResourceError, trio.BrokenResourceError):
        log.warning("registry subscription ended; relying on the periodic refresh")
    finally:
        close = getattr(sub, "close", None)
        if close is not None:
            close()


async def registry_component(pod, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Root-nursery component: sets ``pod.registry`` and keeps it fresh."""
    cache = RegistryCache(pod.settings.route_set)
    async with trio.open_nursery() as nursery:
        if pod.pglistener is not None:
            # Subscribe before the first load: a write between load and subscribe would
            # otherwise be missed until the periodic refresh (LISTEN, then read).
            sub = pod.pglistener.subscribe(channels.REGISTRY)
            nursery.start_soon(_forward_wakes, sub, cache)
        ok = await refresh(pod, cache)
        pod.registry = cache
        task_status.started()
        while True:
            # After a failed load retry within a second instead of a whole refresh period.
            interval = pod.settings.registry_refresh if ok else min(1.0, pod.settings.registry_refresh)
            with trio.move_on_after(interval):
                await cache.wait_poke()
            ok = await refresh(pod, cache)
