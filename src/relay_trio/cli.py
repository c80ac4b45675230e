"""Command line: ``relay-trio serve | migrate | healthcheck | config`` and ``--version``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import trio
from pydantic import ValidationError

from relay_trio import __version__
from relay_trio.config import Settings, config_table
from relay_trio.logs import configure_logging, settings_secrets

log = logging.getLogger("relay_trio.cli")


class CliError(Exception):
    """A problem to report in one paragraph, without a traceback."""


def load_settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        lines = [f"  RELAY_{'.'.join(str(p) for p in e['loc']).upper()}: {e['msg']}" for e in exc.errors()]
        raise CliError("invalid configuration:\n" + "\n".join(lines)) from None


def check_auth_binding(settings: Settings) -> None:
    open_routes = []
    if not settings.ingest_token_list:
        open_routes.append("POST /events (RELAY_INGEST_TOKENS is empty)")
    if not settings.admin_token:
        open_routes.append("/listeners and /deliveries (RELAY_ADMIN_TOKEN is empty)")
    if open_routes and not settings.bind_is_loopback():
        raise CliError(
            f"refusing to bind {settings.bind}: " + " and ".join(open_routes) + " would be open to the network. "
            "Set the tokens, or bind a loopback address (RELAY_BIND=127.0.0.1:8080)."
        )


@contextmanager
def database_dsn(settings: Settings) -> Iterator[str]:
    """The configured DSN, or an embedded cluster started for the lifetime of the block."""
    if settings.database_url:
        yield settings.database_url
        return
    from relay_trio.embedded_pg import EmbeddedPostgres, EmbeddedPostgresError

    try:
        cluster = EmbeddedPostgres(settings.data_dir)
        cluster.start()
    except EmbeddedPostgresError as exc:
        raise CliError(str(exc)) from None
    log.info("embedded PostgreSQL ready in %s", cluster.data_dir)
    try:
        yield cluster.dsn()
    finally:
        if cluster.started_here:
            log.info("stopping embedded PostgreSQL")
            cluster.stop()


FORCED_EXIT_CODE = 1


async def serve_main(settings: Settings, dsn: str) -> None:
    """Run the pod until a signal; the first SIGTERM/SIGINT shuts down gracefully, a second
    one exits at once (``os._exit``: no cleanup, leases then expire on their own).

    A first signal during start-up cancels the start-up (nothing is serving yet).
    Processes started in the background from a non-interactive shell ignore SIGINT, so
    both signals are handled here explicitly rather than through KeyboardInterrupt.
    """
    from relay_trio.service import run_pod

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            pod_holder: list = []

            async def pod_task() -> None:
                try:
                    await run_pod(settings, dsn, task_status=_Started(pod_holder))
                finally:
                    nursery.cancel_scope.cancel()

            nursery.start_soon(pod_task)

            count = 0
            async for signum in signals:
                count += 1
                name = signal.Signals(signum).name
                if count == 1 and pod_holder:
                    log.info("received %s: graceful shutdown (again to exit at once)", name, extra={"signal": name})
                    pod_holder[0].shutting_down.set()
                elif count == 1:
                    log.info("received %s during start-up: stopping", name, extra={"signal": name})
                    nursery.cancel_scope.cancel()
                else:
                    log.warning("received %s again: exiting now", name, extra={"signal": name})
                    logging.shutdown()
                    os._exit(FORCED_EXIT_CODE)


class _Started:
    """A task_status stand-in that records the pod for the signal handler."""

    def __init__(self, holder: list):
        self.holder = holder

    def started(self, value=None) -> None:
        self.holder.append(value)


def cmd_serve(args: argparse.Namespace) -> int:
    settings = load_settings()
    configure_logging(settings.pod_id, settings.log_format, settings.log_level, settings_secrets(settings))
    check_auth_binding(settings)
    with database_dsn(settings) as dsn:
        try:
            trio.run(serve_main, settings, dsn)
        except KeyboardInterrupt:
            pass
    log.info("stopped")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    settings = load_settings()
    configure_logging(settings.pod_id, settings.log_format, settings.log_level, settings_secrets(settings))

    async def main(dsn: str) -> list[int]:
        from relay_trio.db import Database, open_asyncio_loop
        from relay_trio.migrations import migrate_conn

        async with open_asyncio_loop():
            db = await Database.connect(dsn, min_size=1, max_size=1)
            try:
                return await db.run(migrate_conn, timeout=300)
            finally:
                await db.close()

    with database_dsn(settings) as dsn:
        applied = trio.run(main, dsn)
    print(f"applied {len(applied)} migration(s): {applied}" if applied else "schema is up to date")
    return 0


def cmd_healthcheck(args: argparse.Namespace) -> int:
    """Exit 0 when /healthz answers 200 (the container HEALTHCHECK; no curl needed)."""
    settings = load_settings()
    host, port = settings.bind_host_port
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    url = args.url or f"http://{host if ':' not in host else '[' + host + ']'}:{port}/{args.path.lstrip('/')}"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as resp:
            ok = resp.status == 200
    except (urllib.error.URLError, OSError) as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    print("healthy" if ok else "unhealthy")
    return 0 if ok else 1


def cmd_config(args: argparse.Namespace) -> int:
    print(config_table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relay-trio", description=__doc__)
    parser.add_argument("--version", action="version", version=f"relay-trio {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the service (embedded PostgreSQL unless RELAY_DATABASE_URL is set)")
    sub.add_parser("migrate", help="apply schema migrations and exit")
    hc = sub.add_parser("healthcheck", help="probe this pod's /healthz (for container HEALTHCHECK)")
    hc.add_argument("--path", default="/healthz")
    hc.add_argument("--url", default=None)
    hc.add_argument("--timeout", type=float, default=3.0)
    sub.add_parser("config", help="print the configuration table")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"serve": cmd_serve, "migrate": cmd_migrate, "healthcheck": cmd_healthcheck, "config": cmd_config}
    try:
        return handlers[args.command](args)
    except CliError as exc:
        print(f"relay-trio: {exc}", file=sys.stderr)
        return 2
