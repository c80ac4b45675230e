"""Service configuration: every setting is an environment variable with the prefix RELAY_.

The README's configuration table is generated from the field descriptions here
(``relay-trio config``), so this module is the single source of truth.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import uuid
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _default_pod_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RELAY_", extra="ignore")

    database_url: str | None = Field(
        None, description="PostgreSQL DSN. Empty: start the embedded cluster in RELAY_DATA_DIR."
    )
    data_dir: str = Field("./.relay/pg", description="Embedded PostgreSQL data directory.")
    bind: str = Field("127.0.0.1:8080", description="HTTP listen address host:port.")
    pod_id: str = Field(default_factory=_default_pod_id, description="This pod's id (lease owner, logs).")

    ingest_tokens: str = Field("", description="Comma-separated bearer tokens for POST /events; empty = open.")
    admin_token: str = Field("", description="Bearer token for /listeners and /deliveries; empty = open.")
    routes: str = Field("*", description="Comma-separated listener names this pod delivers to; * = all.")

    pool_min_size: int = Field(2, ge=1, description="Minimum database pool size.")
    pool_max_size: int = Field(10, ge=1, description="Maximum database pool size.")
    db_timeout: float = Field(5.0, gt=0, description="Deadline in seconds for one database operation.")
    pool_acquire_timeout: float = Field(2.0, gt=0, description="Seconds to wait for a pooled connection before answering 503.")

    handoff_capacity: int = Field(10, ge=1, description="Capacity of the in-pod hand-off channel.")
    notify_mode: Literal["coalesced", "in-tx", "off"] = Field(
        "coalesced", description="How other pods are woken: coalesced NOTIFY after commit, in-tx NOTIFY, or off."
    )
    notify_window: float = Field(0.005, ge=0, description="Coalescing window for outbox NOTIFYs, seconds.")
    handoff_enabled: bool = Field(True, description="Hand new outbox ids to this pod's worker after commit.")
    listen_enabled: bool = Field(True, description="Run the LISTEN/NOTIFY listener (off = poll and hand-off only).")

    max_in_flight: int = Field(10, ge=1, description="Concurrent deliveries per pod.")
    listener_share: float = Field(0.5, gt=0, le=1, description="Max share of in-flight slots one listener may hold.")
    delivery_timeout: float = Field(5.0, gt=0, description="Total deadline of one delivery attempt, seconds.")
    delivery_retention: float = Field(900.0, gt=0, description="Seconds a row is retried before it is dead.")
    delivered_retention: float = Field(7 * 86400.0, gt=0, description="Seconds delivered rows and attempts are kept.")
    lease_seconds: float = Field(30.0, gt=0, description="Claim lease in seconds (raised to outlive one attempt plus its settle: delivery_timeout + pool_acquire_timeout + db_timeout + 1).")
    poll_min: float = Field(0.25, gt=0, description="Poll interval after activity, seconds.")
    poll_max: float = Field(2.0, gt=0, description="Idle poll ceiling, seconds.")
    retry_base: float = Field(1.0, gt=0, description="First retry delay, seconds.")
    retry_cap: float = Field(300.0, gt=0, description="Longest retry delay, seconds.")
    listener_failure_threshold: int = Field(10, ge=1, description="Consecutive failures before a listener is backed off.")
    listener_backoff_cap: float = Field(600.0, gt=0, description="Longest whole-listener backoff, seconds.")
    listener_backoff_base: float = Field(5.0, gt=0, description="First whole-listener backoff, seconds (doubles per level).")

    heartbeat_interval: float = Field(3.0, gt=0, description="Listener heartbeat period, seconds.")
    heartbeat_timeout: float = Field(2.0, gt=0, description="Listener heartbeat deadline, seconds.")
    registry_refresh: float = Field(30.0, gt=0, description="Safety-net refresh of the listener registry cache.")
    janitor_interval: float = Field(30.0, gt=0, description="Seconds between janitor sweeps.")
    stream_heartbeat: float = Field(15.0, gt=0, description="Seconds between SSE heartbeat comments on an idle stream.")
    stream_poll: float = Field(1.0, gt=0, description="Safety-net re-read interval of an SSE stream, seconds.")

    shutdown_grace: float = Field(10.0, ge=0, description="Seconds in-flight deliveries get on SIGTERM.")
    log_format: Literal["json", "console"] = Field("json", description="Log line format.")
    log_level: str = Field("INFO", description="Log level.")

    target_deny_cidrs: str = Field(
        "169.254.0.0/16,fd00:ec2::254/128,fe80::/10",
        description="Comma-separated CIDRs deliveries may never connect to.",
    )
    target_allow_cidrs: str = Field("", description="Comma-separated CIDRs allowed even if denied.")

    @field_validator("routes")
    @classmethod
    def _routes_not_empty(cls, v: str) -> str:
        if not _split(v):
            raise ValueError("RELAY_ROUTES must name at least one listener or be *")
        return v

    # -- parsed views -------------------------------------------------------------------
    @property
    def ingest_token_list(self) -> list[str]:
        return _split(self.ingest_tokens)

    @property
    def route_set(self) -> frozenset[str] | None:
        """None means every listener."""
        parts = _split(self.routes)
        return None if "*" in parts else frozenset(parts)

    @property
    def bind_host_port(self) -> tuple[str, int]:
        host, _, port = self.bind.rpartition(":")
        return host.strip("[]") or "127.0.0.1", int(port)

    @property
    def deny_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        return [ipaddress.ip_network(c, strict=False) for c in _split(self.target_deny_cidrs)]

    @property
    def allow_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        return [ipaddress.ip_network(c, strict=False) for c in _split(self.target_allow_cidrs)]

    def bind_is_loopback(self) -> bool:
        host, _ = self.bind_host_port
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False


def config_table() -> str:
    """Markdown table of every setting, for the README."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = "(generated)" if field.default_factory else repr(field.default)
        rows.append(f"| `RELAY_{name.upper()}` | `{default}` | {field.description or ''} |")
    return "\n".join(rows)
