"""The HTTP client deliveries are sent with, and the guard that decides where it may connect.

Why a custom network backend: a check of the URL's host before the request is not enough,
because DNS can answer differently at connect time (DNS rebinding) and send a delivery to
the cloud metadata service. So the guard sits *below* httpx, in httpcore's network
backend: it resolves the host itself, checks every resolved address against the deny and
allow networks (allow wins), and then connects to one of the addresses it checked, never
to the name. TLS still verifies the certificate against the original host name (httpcore
passes the URL's host as ``server_hostname``), so HTTPS keeps working.

Other choices, each for a reason:
* redirects are never followed (Standard Webhooks: a 3xx is a failure; a redirect could
  also point at a denied address);
* no timeouts in httpx: the delivery engineer bounds each attempt with a trio cancel scope;
* ``trust_env=False``: an HTTP(S)_PROXY in the environment would make the guard check the
  proxy's address instead of the target's;
* no retries inside httpcore: the delivery loop owns the retry schedule.

A refused target raises ``TargetRefused``; httpx turns it into ``httpx.ConnectError`` with
the same message, so the sender records it as the attempt's error like any other
connection failure.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import typing
from collections.abc import Awaitable, Callable, Sequence

import anyio
import httpcore
import httpx
from httpcore import AsyncNetworkBackend, AsyncNetworkStream
from httpcore._backends.auto import AutoBackend

from relay_trio.config import Settings

log = logging.getLogger("relay_trio.delivery.http_client")

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# host, port -> resolved IP address strings (tests inject one to simulate DNS rebinding)
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


class TargetRefused(httpcore.ConnectError):
    """The delivery target resolves only to addresses this pod may not connect to."""


async def system_resolver(host: str, port: int) -> list[str]:
    """Resolve ``host`` with the system resolver (works under trio and asyncio)."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out: list[str] = []
    for family, _type, _proto, _canon, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        addr = str(sockaddr[0]).split("%", 1)[0]  # drop an IPv6 zone id ("fe80::1%eth0")
        if addr not in out:
            out.append(addr)
    return out


class TargetPolicy:
    """Deny/allow networks for delivery targets; an address in an allow network always passes."""

    def __init__(self, deny: Sequence[IPNetwork], allow: Sequence[IPNetwork] = ()):
        self.deny = list(deny)
        self.allow = list(allow)

    @classmethod
    def from_settings(cls, settings: Settings) -> TargetPolicy:
        return cls(settings.deny_networks, settings.allow_networks)

    def refusal(self, address: str) -> str | None:
        """Why ``address`` may not be connected to, or None when it may."""
        try:
            ip: IPAddress = ipaddress.ip_address(address)
        except ValueError:
            return f"{address!r} is not an IP address"
        candidates: list[IPAddress] = [ip]
        # ::ffff:169.254.169.254 reaches the IPv4 address: check both spellings.
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            candidates.append(ip.ipv4_mapped)
        for cand in candidates:
            if any(cand.version == net.version and cand in net for net in self.allow):
                return None
        for cand in candidates:
            for net in self.deny:
                if cand.version == net.version and cand in net:
                    return f"{address} is in the denied network {net}"
        return None


class GuardedBackend(AsyncNetworkBackend):
    """httpcore network backend: resolve, check every address, connect to a checked IP."""

    def __init__(self, policy: TargetPolicy, resolver: Resolver | None = None, inner: AsyncNetworkBackend | None = None):
        self.policy = policy
        self.resolver: Resolver = resolver or system_resolver
        self.inner = inner or AutoBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> AsyncNetworkStream:
        try:
            addresses = list(await self.resolver(host, port))
        except OSError as exc:  # socket.gaierror and friends
            raise httpcore.ConnectError(f"cannot resolve {host!r}: {exc}") from exc
        permitted: list[str] = []
        refusals: list[str] = []
        for address in addresses:
            why = self.policy.refusal(address)
            if why is None:
                permitted.append(address)
            else:
                refusals.append(why)
        if not permitted:
            detail = "; ".join(refusals) or "no addresses"
            log.warning("delivery target refused", extra={"target_host": host, "reason": detail})
            raise TargetRefused(f"delivery target {host!r} refused: {detail}")
        options = list(socket_options) if socket_options is not None else None
        last: Exception | None = None
        for address in permitted:
            try:
                return await self.inner.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address, socket_options=options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout, OSError) as exc:
                last = exc
        assert last is not None
        if isinstance(last, httpcore.ConnectError | httpcore.ConnectTimeout):
            raise last
        raise httpcore.ConnectError(str(last)) from last

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):  # pragma: no cover
        raise TargetRefused("unix socket delivery targets are not allowed")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport with its connection pool built on ``GuardedBackend``."""

    def __init__(self, backend: GuardedBackend, limits: httpx.Limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)):
        super().__init__(trust_env=False, retries=0, limits=limits)
        ssl_context = httpx.create_ssl_context(trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            http1=True,
            http2=False,
            retries=0,
            network_backend=backend,
        )


def make_http_client(settings: Settings, *, resolver: Resolver | None = None) -> httpx.AsyncClient:
    """The pod's one delivery client: guarded connects, no redirects, no httpx timeouts.

    ``resolver`` replaces DNS (tests use it to play a rebinding resolver).
    """
    backend = GuardedBackend(TargetPolicy.from_settings(settings), resolver=resolver)
    return httpx.AsyncClient(
        transport=GuardedTransport(backend),
        follow_redirects=False,
        timeout=httpx.Timeout(None),
        trust_env=False,
        headers={"user-agent": "relay-trio"},
    )
