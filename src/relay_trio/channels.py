"""NOTIFY channel names (all well under PostgreSQL's 63-byte limit).

Payloads are hints only: every subscriber re-reads state on each wake.
"""

OUTBOX = "relay_outbox"      # new outbox rows some other pod may route (payload: listener names, comma-separated)
REGISTRY = "relay_registry"  # listener registry changed (payload: listener name)
EVENTS = "relay_events"      # events committed (pull streams; payload: highest seq)
HEARTBEAT_PREFIX = "relay_hb_"  # + pod-specific suffix: the listener's NOTIFY round trip to itself

MAX_CHANNEL_BYTES = 63
MAX_PAYLOAD_BYTES = 7999
