-- relay-trio schema, version 1.
-- Every table the service needs: events, listeners, the outbox (deliveries) with its
-- lease columns, the attempt log, consumer offsets for pull streams, and leased locks.

-- Events ------------------------------------------------------------------------------
-- seq is monotonic and assigned at insert. For pull streams to read "everything after
-- seq N" without gaps, a lower seq must never commit after a higher one is visible. The
-- trigger below assigns txid and seq together under a momentary (session-level, released
-- before the statement ends) advisory lock, so seq order equals transaction-id order; a
-- reader then only returns rows whose transaction is older than every transaction still
-- running (txid < pg_snapshot_xmin(pg_current_snapshot())). This holds because the event
-- insert is the first write of its transaction.
CREATE TABLE events (
    seq          bigint PRIMARY KEY,
    txid         xid8 NOT NULL,
    id           text NOT NULL UNIQUE,
    channel      text NOT NULL,
    author       text NOT NULL,
    content      text NOT NULL,
    mentions     text[] NOT NULL DEFAULT '{}',
    meta         jsonb NOT NULL DEFAULT '{}'::jsonb,
    body_hash    text NOT NULL,
    response     jsonb,
    accepted_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE SEQUENCE events_seq AS bigint OWNED BY events.seq;

CREATE FUNCTION relay_assign_event_seq() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_lock(72604210001);
    NEW.txid := pg_current_xact_id();
    NEW.seq := nextval('events_seq');
    PERFORM pg_advisory_unlock(72604210001);
    RETURN NEW;
END;
$$;

CREATE TRIGGER events_assign_seq BEFORE INSERT ON events
    FOR EACH ROW EXECUTE FUNCTION relay_assign_event_seq();

CREATE INDEX events_mentions ON events USING gin (mentions);

-- Listeners (the registry) ------------------------------------------------------------
CREATE TABLE listeners (
    name                  text PRIMARY KEY,
    url                   text NOT NULL,
    secret                text NOT NULL,
    enabled               boolean NOT NULL DEFAULT true,
    disabled_reason       text,
    stream_token_hash     text,
    consecutive_failures  integer NOT NULL DEFAULT 0,
    backoff_level         integer NOT NULL DEFAULT 0,
    paused_until          timestamptz,
    created_at            timestamptz NOT NULL DEFAULT now(),
    updated_at            timestamptz NOT NULL DEFAULT now()
);

-- The outbox ------------------------------------------------------------------------------
-- One row per (event, mentioned listener). listener is a name, not a foreign key: a
-- deleted listener's rows stay, dead with reason 'listener_deleted'.
-- A row is claimable when pending, due, and not leased (or its lease expired).
-- lease_token is the fencing token: it changes on every claim, and complete/retry/release
-- only apply when the caller presents the current one.
CREATE SEQUENCE fencing_tokens AS bigint;

CREATE TABLE deliveries (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_seq     bigint NOT NULL REFERENCES events (seq) ON DELETE CASCADE,
    listener      text NOT NULL,
    status        text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'delivered', 'dead')),
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    due_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    attempts      integer NOT NULL DEFAULT 0,
    lease_owner   text,
    lease_until   timestamptz,
    lease_token   bigint,
    claimed_at    timestamptz,
    claimed_via   text,
    delivered_at  timestamptz,
    dead_reason   text,
    last_error    text,
    updated_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX deliveries_due ON deliveries (due_at, id) WHERE status = 'pending';
CREATE INDEX deliveries_listener_status ON deliveries (listener, status, id DESC);
CREATE INDEX deliveries_status_id ON deliveries (status, id DESC);
CREATE INDEX deliveries_lease_owner ON deliveries (lease_owner) WHERE status = 'pending' AND lease_owner IS NOT NULL;
CREATE INDEX deliveries_event ON deliveries (event_seq);

CREATE TABLE delivery_attempts (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    delivery_id    bigint NOT NULL REFERENCES deliveries (id) ON DELETE CASCADE,
    attempt        integer NOT NULL,
    pod_id         text NOT NULL,
    started_at     timestamptz NOT NULL,
    duration_ms    double precision NOT NULL,
    outcome        text NOT NULL,
    status_code    integer,
    error          text,
    response_body  text
);
CREATE INDEX delivery_attempts_delivery ON delivery_attempts (delivery_id, id);
CREATE INDEX delivery_attempts_started ON delivery_attempts (started_at);

-- Pull-stream consumer offsets -------------------------------------------------------------
CREATE TABLE consumer_offsets (
    listener    text PRIMARY KEY,
    seq         bigint NOT NULL CHECK (seq >= 0),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- Leased locks (the janitor and anything else that must run on one pod at a time) ----------
CREATE TABLE locks (
    name        text PRIMARY KEY,
    owner       text NOT NULL,
    token       bigint NOT NULL,
    expires_at  timestamptz NOT NULL,
    acquired_at timestamptz NOT NULL DEFAULT now()
);
