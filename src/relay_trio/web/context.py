"""Access to the running Pod from inside a request handler."""

from __future__ import annotations

from quart import current_app

from relay_trio.runtime import Pod


def pod() -> Pod:
    return current_app.extensions["relay_pod"]
