"""A private PostgreSQL cluster: the default database of ``relay-trio serve``, and the
throwaway cluster of the test suite.

The cluster listens only on a unix socket in its own directory (``listen_addresses=''``),
so it never collides with a system PostgreSQL on 5432. initdb refuses to run as root; when
this process is root, the cluster runs as an unprivileged system user.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("relay_trio.embedded_pg")

DB_USER = "relay"
DEFAULT_DB = "relay"
PORT = 5432
RUN_AS_IF_ROOT = ("postgres", "relay-pg")  # existing users tried first; the last is created

MISSING_BINARIES_HELP = (
    "relay-trio could not find the PostgreSQL server binaries (initdb, pg_ctl, postgres). "
    "With no RELAY_DATABASE_URL set, the service starts its own embedded PostgreSQL and "
    "needs them installed: on Debian/Ubuntu `apt-get install postgresql` (they land in "
    "/usr/lib/postgresql/<version>/bin), on Fedora `dnf install postgresql-server`, on macOS "
    "`brew install postgresql`. Alternatively point RELAY_DATABASE_URL at an existing server."
)


class EmbeddedPostgresError(RuntimeError):
    """The embedded cluster could not be created or started (message is for humans)."""


def find_bindir() -> Path:
    """PATH first, then ``pg_config --bindir``, then /usr/lib/postgresql/*/bin (newest)."""
    candidates: list[Path] = []
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(os.path.realpath(on_path)).parent)
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                candidates.append(Path(out.stdout.strip()))
        except (OSError, subprocess.SubprocessError):
            pass

    def version_key(p: str) -> tuple[int, ...]:
        digits = Path(p).parent.name.split(".")
        return tuple(int(d) for d in digits if d.isdigit())

    for bindir in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version_key, reverse=True):
        candidates.append(Path(bindir))
    for c in candidates:
        if all((c / exe).exists() for exe in ("initdb", "pg_ctl", "postgres")):
            return c
    raise EmbeddedPostgresError(MISSING_BINARIES_HELP)


def _socket_dir_for(data_dir: Path) -> Path:
    """unix socket paths are limited to ~107 bytes; fall back to a short /tmp path."""
    if len(str(data_dir)) + len("/.s.PGSQL.5432") < 100:
        return data_dir
    digest = hashlib.sha1(str(data_dir).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"relay-pg-{digest}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class EmbeddedPostgres:
    data_dir: Path
    for_tests: bool = False
    bindir: Path = field(default_factory=find_bindir)
    started_here: bool = False

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).absolute()
        self.socket_dir = _socket_dir_for(self.data_dir)
        self.log_file = self.data_dir.parent / (self.data_dir.name + ".log")
        self._user: pwd.struct_passwd | None = self._pick_user() if os.geteuid() == 0 else None

    # -- identity ------------------------------------------------------------------------
    @staticmethod
    def _pick_user() -> pwd.struct_passwd:
        for name in RUN_AS_IF_ROOT:
            try:
                return pwd.getpwnam(name)
            except KeyError:
                continue
        name = RUN_AS_IF_ROOT[-1]
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"
        result = subprocess.run(
            [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise EmbeddedPostgresError(
                f"running as root, and could not create the unprivileged user {name!r} to run "
                f"PostgreSQL as (initdb refuses root): {result.stderr.strip()}"
            )
        return pwd.getpwnam(name)

    def _run(self, args: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
        if self._user is not None:
            kwargs.setdefault("user", self._user.pw_uid)
            kwargs.setdefault("group", self._user.pw_gid)
            kwargs.setdefault("extra_groups", [])
            kwargs.setdefault("cwd", "/")
        return subprocess.run(args, capture_output=True, text=True, **kwargs)

    def _chown_tree(self, path: Path) -> None:
        if self._user is None:
            return
        os.chown(path, self._user.pw_uid, self._user.pw_gid)
        for root, dirs, files in os.walk(path):
            for n in dirs + files:
                os.chown(os.path.join(root, n), self._user.pw_uid, self._user.pw_gid)

    def _make_reachable(self, path: Path) -> None:
        """Let the unprivileged server user traverse every parent of ``path``."""
        if self._user is None:
            return
        for parent in list(path.parents)[::-1]:
            try:
                mode = parent.stat().st_mode
                if not mode & 0o001:
                    os.chmod(parent, mode | 0o001)
            except OSError:
                pass

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return (self.data_dir / "PG_VERSION").exists()

    def init(self) -> None:
        if self.initialized:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        self._make_reachable(self.data_dir)
        self._chown_tree(self.data_dir)
        result = self._run(
            [
                str(self.bindir / "initdb"),
                "-D", str(self.data_dir),
                "-U", DB_USER,
                "--auth=trust",
                "-E", "UTF8",
                "--locale=C",
                *(["--no-sync"] if self.for_tests else []),
            ]
        )
        if result.returncode != 0:
            raise EmbeddedPostgresError(f"initdb failed in {self.data_dir}:\n{result.stderr.strip()}")
        settings = {
            "listen_addresses": "''",
            "unix_socket_directories": f"'{self.socket_dir}'",
            "port": str(PORT),
            "max_connections": "300" if self.for_tests else "100",
            "shared_buffers": "128MB",
            "log_min_messages": "warning",
        }
        if self.for_tests:
            settings.update({"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"})
        with open(self.data_dir / "postgresql.conf", "a") as conf:
            conf.write("\n# relay-trio embedded cluster\n")
            for k, v in settings.items():
                conf.write(f"{k} = {v}\n")
        self._chown_tree(self.data_dir)

    def _clear_stale_pid(self) -> None:
        pidfile = self.data_dir / "postmaster.pid"
        if not pidfile.exists():
            return
        try:
            pid = int(pidfile.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            pid = -1
        if pid <= 0 or not _pid_alive(pid):
            log.warning("removing stale postmaster.pid (pid %s is gone)", pid)
            pidfile.unlink(missing_ok=True)

    def is_running(self) -> bool:
        result = self._run([str(self.bindir / "pg_ctl"), "status", "-D", str(self.data_dir)])
        return result.returncode == 0

    def start(self) -> None:
        """Create (first time) and start the cluster; reuse it if it already runs."""
        self.init()
        if self.is_running():
            log.info("embedded PostgreSQL already running in %s; reusing it", self.data_dir)
            return
        self._clear_stale_pid()
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        self._make_reachable(self.socket_dir)
        if self.socket_dir != self.data_dir:
            self._chown_tree(self.socket_dir)
        self.log_file.touch(exist_ok=True)
        if self._user is not None:
            os.chown(self.log_file, self._user.pw_uid, self._user.pw_gid)
        result = self._run(
            [str(self.bindir / "pg_ctl"), "start", "-w", "-t", "60", "-D", str(self.data_dir), "-l", str(self.log_file)]
        )
        if result.returncode != 0:
            tail = ""
            try:
                tail = "\n".join(self.log_file.read_text().splitlines()[-15:])
            except OSError:
                pass
            raise EmbeddedPostgresError(
                f"PostgreSQL did not start in {self.data_dir}:\n{result.stderr.strip()}\n{tail}"
            )
        self.started_here = True
        self.ensure_database(DEFAULT_DB)

    def stop(self, mode: str = "fast") -> None:
        self._run([str(self.bindir / "pg_ctl"), "stop", "-w", "-t", "60", "-m", mode, "-D", str(self.data_dir)])

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data_dir / "postmaster.pid").read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill(self) -> None:
        pid = self.postmaster_pid()
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # -- connection ----------------------------------------------------------------------
    def dsn(self, dbname: str = DEFAULT_DB) -> str:
        return f"postgresql://{DB_USER}@/{dbname}?host={self.socket_dir}&port={PORT}"

    def ensure_database(self, name: str) -> None:
        from relay_trio.db import admin_execute_sync, admin_fetchval_sync, quote_ident

        admin = self.dsn("postgres")
        if not admin_fetchval_sync(admin, "SELECT 1 FROM pg_database WHERE datname = $1", name):
            admin_execute_sync(admin, f"CREATE DATABASE {quote_ident(name)}")
