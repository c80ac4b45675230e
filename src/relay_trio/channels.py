"""NOTIFY channel names (all well under PostgreSQL's 63-byte limit).

Payloads are hints only: every subscriber re-reads state on each wake.
"""

OUTBOX = "relay_outbox"      # new outbox rows some other pod may route (payload: listener names, comma-separated)
REGISTRY = "relay_registry"  # listener registry changed (payload: listener name)
EVENTS = "relay_events"      # events committed (pull streams; payload: highest seq)
HEARTBEAT_PREFIX = "relay_hb_"  # + pod-specific suffix: the listener's NOTIFY round trip to itself

MAX_CHANNEL_BYTES = 63
MAX_PAYLOAD_BYTES = 7999


class NotifyPayloadTooLarge(ValueError):
    """A NOTIFY payload PostgreSQL would refuse (>= 8000 bytes), caught before it is sent.

    The server's own refusal (SQLSTATE 22023) would abort the caller's transaction; a
    payload is only a hint, so callers should send a shorter one (or none) instead.
    """


def check_channel_name(channel: str) -> None:
    """Refuse channel names PostgreSQL would truncate or reject (> 63 bytes, empty, NUL)."""
    size = len(channel.encode("utf-8"))
    if not channel or size > MAX_CHANNEL_BYTES or "\x00" in channel:
        raise ValueError(f"invalid NOTIFY channel name {channel[:80]!r}: must be 1..{MAX_CHANNEL_BYTES} bytes, no NUL")


def check_notify_payload(channel: str, payload: str | None) -> None:
    """Raise before sending a NOTIFY the server would refuse (payload over 7999 bytes)."""
    check_channel_name(channel)
    size = len((payload or "").encode("utf-8"))
    if size > MAX_PAYLOAD_BYTES:
        raise NotifyPayloadTooLarge(
            f"NOTIFY payload on {channel!r} is {size} bytes; PostgreSQL accepts at most {MAX_PAYLOAD_BYTES}"
        )
