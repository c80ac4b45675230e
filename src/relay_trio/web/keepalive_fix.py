"""Make hypercorn's idle-connection timer survive quart-trio (keep-alive and shutdown).

hypercorn (0.18, trio worker) closes an idle keep-alive connection from a per-connection
"idle task": it waits for ``keep_alive_timeout`` or for the server's shutdown, then closes
the socket. After each response the task is restarted with ``nursery.start`` from inside
the request's task. quart-trio cancels that request nursery as soon as the response is
done, and ``nursery.start`` runs the new task under the caller's cancel scopes until it
reports started, so the fresh idle task is cancelled at birth. The result: after its first
request a keep-alive connection has no idle timer at all, is never closed for idleness,
and holds a graceful shutdown for the whole graceful timeout.

The fix starts the idle task from a shielded scope (``started()`` is its first step, so
the shield covers a single scheduling step). ``install()`` is idempotent.
"""

from __future__ import annotations

import trio
from hypercorn.trio import worker_context

_INSTALLED = "_relay_trio_shielded_restart"


def install() -> None:
    cls = worker_context.TrioSingleTask
    if getattr(cls, _INSTALLED, False):
        return
    original = cls.restart

    async def restart(self, task_group, action) -> None:  # type: ignore[no-untyped-def]
        with trio.CancelScope(shield=True):
            await original(self, task_group, action)

    restart.__doc__ = original.__doc__
    cls.restart = restart  # type: ignore[method-assign]
    setattr(cls, _INSTALLED, True)
