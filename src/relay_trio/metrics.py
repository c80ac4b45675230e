"""Prometheus metrics for one pod (its own registry, so tests can run several pods in one
process). Label cardinality is bounded: listener names (bounded by the registry), wake
paths, outcomes and reasons; never event or delivery ids.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # intake
        self.events_accepted = Counter("relay_events_accepted", "Events accepted (202).", registry=r)
        self.events_rejected = Counter("relay_events_rejected", "Events rejected, by reason.", ["reason"], registry=r)
        self.outbox_enqueued = Counter("relay_outbox_enqueued", "Outbox rows written.", registry=r)
        self.handoffs_sent = Counter("relay_handoffs_sent", "Outbox ids handed to this pod's worker.", registry=r)
        self.handoffs_dropped = Counter("relay_handoffs_dropped", "Hand-offs dropped: channel full.", registry=r)
        self.notifies_sent = Counter("relay_notifies_sent", "Outbox NOTIFYs sent.", ["channel"], registry=r)
        self.notifies_merged = Counter("relay_notifies_merged", "NOTIFY requests merged into another.", ["channel"], registry=r)
        # delivery
        self.deliveries = Counter("relay_deliveries", "Delivery attempts by outcome.", ["outcome"], registry=r)
        self.claims = Counter("relay_claims", "Rows claimed, by the wake path that claimed them.", ["path"], registry=r)
        self.wake_misses = Counter(
            "relay_wake_misses",
            "Rows claimed by the poll although due more than one poll interval earlier (lost wake-ups).",
            registry=r,
        )
        self.commit_to_claim = Histogram(
            "relay_commit_to_claim_seconds", "From the row's commit to its first claim.", ["path"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.commit_to_delivered = Histogram(
            "relay_commit_to_delivered_seconds", "From the row's commit to its successful delivery.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.in_flight = Gauge("relay_deliveries_in_flight", "Deliveries running now.", registry=r)
        self.pending_age = Gauge(
            "relay_oldest_pending_age_seconds", "Age of the oldest pending row, per listener.", ["listener"], registry=r
        )
        # listener connection
        self.listener_state = Gauge(
            "relay_listener_state", "1 for the listener connection's current state.", ["state"], registry=r
        )
        self.listener_reconnects = Counter("relay_listener_reconnects", "Listener reconnects.", registry=r)
        self.listener_heartbeat_rtt = Gauge(
            "relay_listener_heartbeat_rtt_seconds", "Last heartbeat round trip.", registry=r
        )
        self.listener_wakes = Counter("relay_listener_wakes", "Wakes delivered to subscribers.", ["channel"], registry=r)
        # janitor
        self.janitor_sweeps = Counter("relay_janitor_sweeps", "Janitor sweeps run by this pod.", registry=r)
        self.janitor_rows = Counter("relay_janitor_rows", "Rows the janitor changed, by action.", ["action"], registry=r)
        # pull streams (SSE)
        self.streams_open = Gauge("relay_streams_open", "SSE stream connections open now.", registry=r)
        self.stream_events_sent = Counter("relay_stream_events_sent", "Events sent on SSE streams.", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
