"""The Pod: one running relay process's shared state, handed to every component.

Components take the pieces they need from it; nothing here does I/O by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio

from relay_trio.config import Settings
from relay_trio.db import Database
from relay_trio.metrics import Metrics


@dataclass
class Pod:
    settings: Settings
    db: Database
    metrics: Metrics
    pod_id: str
    # Hand-off: the saving pod gives new outbox ids to its own delivery worker.
    handoff_send: trio.MemorySendChannel[int]
    handoff_recv: trio.MemoryReceiveChannel[int]
    # Filled by the components as they start (None until then / when disabled).
    pglistener: Any = None       # relay_trio.pglistener.PgListener
    notifier: Any = None         # relay_trio.notifier.CoalescedNotifier
    registry: Any = None         # relay_trio.registry.RegistryCache
    delivery: Any = None         # the delivery loop's status object
    janitor: Any = None
    # Liveness of supervised tasks, for /readyz: name -> alive?
    tasks_alive: dict[str, bool] = field(default_factory=dict)
    shutting_down: trio.Event = field(default_factory=trio.Event)
    bound_urls: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, settings: Settings, db: Database, metrics: Metrics | None = None) -> Pod:
        send, recv = trio.open_memory_channel[int](settings.handoff_capacity)
        return cls(
            settings=settings,
            db=db,
            metrics=metrics or Metrics(),
            pod_id=settings.pod_id,
            handoff_send=send,
            handoff_recv=recv,
        )

    @property
    def base_url(self) -> str:
        return self.bound_urls[0] if self.bound_urls else ""
