-- Delivery: claims, settlement (fencing-checked), release, and the admin API's reads.
-- Parameters are positional; relay_trio/store/claims.py names them.

-- name: claim_rows
-- The one claim statement. claim_due uses it as is; claim_by_id replaces the by_id
-- marker comment below with "AND d.id = ANY($9::bigint[])" (relay_trio.store.claims), so both paths
-- share every condition: pending, due, not leased (or lease expired), listener present,
-- enabled and not paused, route filter ($3, NULL = every listener), and the per-listener
-- in-flight budget ($6/$7 remaining slots per busy listener, $8 for the others).
-- Rows are locked with SKIP LOCKED in a CTE (with a LIMIT, so the planner cannot update
-- more rows than asked), ranked per listener to apply the budget, then leased with a
-- fresh fencing token; attempts counts claims (an attempt starts when a row is claimed).
-- $1 owner, $2 lease seconds, $3 routes, $4 limit, $5 claimed_via.
WITH locked AS (
    -- claimable_since: when this row last became claimable (due, its previous lease
    -- expired, its listener's pause over); greatest() ignores NULLs.
    SELECT d.id, d.listener, d.due_at, greatest(d.due_at, d.lease_until, l.paused_until) AS claimable_since,
           l.backoff_level
    FROM deliveries d
    JOIN listeners l ON l.name = d.listener
    WHERE d.status = 'pending'
      AND d.due_at <= clock_timestamp()
      AND (d.lease_until IS NULL OR d.lease_until <= clock_timestamp())
      AND l.enabled
      AND (l.paused_until IS NULL OR l.paused_until <= clock_timestamp())
      -- a backed-off listener (its pause over, no success since) gets ONE probe at a
      -- time, across all pods: no row of it may be claimed while another one is leased
      AND (l.backoff_level = 0 OR NOT EXISTS (
            SELECT 1 FROM deliveries p
            WHERE p.listener = d.listener AND p.status = 'pending' AND p.lease_until > clock_timestamp()))
      AND ($3::text[] IS NULL OR d.listener = ANY($3::text[]))
      AND COALESCE((SELECT c.n FROM unnest($6::text[], $7::int[]) AS c(listener, n)
                    WHERE c.listener = d.listener LIMIT 1), $8::int) > 0
      /*by_id*/
    ORDER BY d.due_at, d.id
    LIMIT $4::int * 4
    FOR UPDATE OF d SKIP LOCKED
), ranked AS (
    SELECT lk.id, lk.due_at, lk.claimable_since,
           row_number() OVER (PARTITION BY lk.listener ORDER BY lk.due_at, lk.id) AS rn,
           CASE WHEN lk.backoff_level > 0 THEN 1
                ELSE COALESCE((SELECT c.n FROM unnest($6::text[], $7::int[]) AS c(listener, n)
                               WHERE c.listener = lk.listener LIMIT 1), $8::int) END AS budget
    FROM locked lk
), chosen AS (
    SELECT id, claimable_since FROM ranked WHERE rn <= budget ORDER BY due_at, id LIMIT $4::int
)
UPDATE deliveries d
SET lease_owner = $1,
    lease_until = clock_timestamp() + make_interval(secs => $2::float8),
    lease_token = nextval('fencing_tokens'),
    attempts = d.attempts + 1,
    claimed_at = clock_timestamp(),
    claimed_via = $5,
    updated_at = clock_timestamp()
FROM chosen c, listeners l, events e
WHERE d.id = c.id AND l.name = d.listener AND e.seq = d.event_seq
RETURNING d.id, d.listener, d.attempts, d.lease_token,
          EXTRACT(EPOCH FROM d.claimed_at - d.created_at)::float8 AS age_seconds,
          EXTRACT(EPOCH FROM d.claimed_at - c.claimable_since)::float8 AS overdue_seconds,
          l.url, l.secret,
          e.id AS event_id, e.seq AS event_seq, e.channel, e.author, e.content,
          e.mentions, e.meta::text AS meta, e.accepted_at;

-- name: insert_attempt
INSERT INTO delivery_attempts
    (delivery_id, attempt, pod_id, started_at, duration_ms, outcome, status_code, error, response_body)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9);

-- name: complete_delivery
-- Fencing: only the holder of the current token settles a row, once (the token is cleared).
UPDATE deliveries
SET status = 'delivered', delivered_at = clock_timestamp(), last_error = NULL,
    lease_owner = NULL, lease_until = NULL, lease_token = NULL, updated_at = clock_timestamp()
WHERE id = $1 AND lease_token = $2 AND status = 'pending'
RETURNING EXTRACT(EPOCH FROM delivered_at - created_at)::float8 AS age_seconds;

-- name: settle_delivered
-- The common success settle in ONE statement (an implicit transaction: no BEGIN/COMMIT
-- round trips): record the attempt and complete the row (fencing-checked), but only when
-- the listener's failure state is clean. A dirty listener (failures, backoff, pause) makes
-- this statement write nothing and say so (listener_clean = false); the caller then runs
-- the locked multi-statement settle (settle_delivered_tx), which resets the listener and
-- takes its lock first. Like settle_delivered_tx: a missing listener counts as clean, and
-- the attempt is recorded even when the token is stale (age_seconds is then NULL).
-- $1 delivery id, $2 token, $3 listener, $4.. the attempt (as in insert_attempt).
WITH state AS (
    SELECT NOT COALESCE((SELECT consecutive_failures <> 0 OR backoff_level <> 0 OR paused_until IS NOT NULL
                         FROM listeners WHERE name = $3), false) AS clean
), attempt AS (
    INSERT INTO delivery_attempts
        (delivery_id, attempt, pod_id, started_at, duration_ms, outcome, status_code, error, response_body)
    SELECT $1::bigint, $4::int, $5::text, $6::timestamptz, $7::float8, $8::text, $9::int, $10::text, $11::text
    FROM state WHERE state.clean
), done AS (
    UPDATE deliveries
    SET status = 'delivered', delivered_at = clock_timestamp(), last_error = NULL,
        lease_owner = NULL, lease_until = NULL, lease_token = NULL, updated_at = clock_timestamp()
    WHERE id = $1::bigint AND lease_token = $2::bigint AND status = 'pending'
      AND (SELECT clean FROM state)
    RETURNING EXTRACT(EPOCH FROM delivered_at - created_at)::float8 AS age_seconds
)
SELECT (SELECT clean FROM state) AS listener_clean, (SELECT age_seconds FROM done) AS age_seconds;

-- name: retry_delivery
-- A failed attempt: due again after $3 seconds, or dead when the row is older than the
-- retention ($4 seconds). $5 is the attempt's error summary.
UPDATE deliveries
SET status = CASE WHEN clock_timestamp() - created_at >= make_interval(secs => $4::float8)
                  THEN 'dead' ELSE 'pending' END,
    dead_reason = CASE WHEN clock_timestamp() - created_at >= make_interval(secs => $4::float8)
                       THEN 'retention' END,
    due_at = clock_timestamp() + make_interval(secs => $3::float8),
    last_error = $5,
    lease_owner = NULL, lease_until = NULL, lease_token = NULL, updated_at = clock_timestamp()
WHERE id = $1 AND lease_token = $2 AND status = 'pending'
RETURNING status;

-- name: dead_letter_delivery
UPDATE deliveries
SET status = 'dead', dead_reason = $3, last_error = $4,
    lease_owner = NULL, lease_until = NULL, lease_token = NULL, updated_at = clock_timestamp()
WHERE id = $1 AND lease_token = $2 AND status = 'pending'
RETURNING id;

-- name: disable_listener
UPDATE listeners SET enabled = false, disabled_reason = $2, updated_at = now()
WHERE name = $1;

-- name: dead_letter_listener_rows
UPDATE deliveries
SET status = 'dead', dead_reason = $2,
    lease_owner = NULL, lease_until = NULL, lease_token = NULL, updated_at = clock_timestamp()
WHERE listener = $1 AND status = 'pending';

-- name: listener_lock_for_settle
-- Settles that change the listener take its row lock FIRST, before any delivery row:
-- DELETE /listeners and a 410 settle lock the listener, then its deliveries, so every
-- path must take the locks in that order or two of them can deadlock.
SELECT consecutive_failures <> 0 OR backoff_level <> 0 OR paused_until IS NOT NULL AS dirty
FROM listeners WHERE name = $1
FOR NO KEY UPDATE;

-- name: listener_failed
-- One more consecutive failure; "paused" tells whether a whole-listener backoff is running.
UPDATE listeners
SET consecutive_failures = consecutive_failures + 1
WHERE name = $1
RETURNING consecutive_failures, backoff_level,
          (paused_until IS NOT NULL AND paused_until > clock_timestamp()) AS paused;

-- name: pause_listener
UPDATE listeners
SET backoff_level = $2, paused_until = clock_timestamp() + make_interval(secs => $3::float8)
WHERE name = $1;

-- name: listener_succeeded
UPDATE listeners SET consecutive_failures = 0, backoff_level = 0, paused_until = NULL
WHERE name = $1 AND (consecutive_failures <> 0 OR backoff_level <> 0 OR paused_until IS NOT NULL);

-- name: release_leases
-- Give rows back (shutdown): only where the caller still holds the token; due at once.
UPDATE deliveries d
SET lease_owner = NULL, lease_until = NULL, lease_token = NULL, updated_at = clock_timestamp()
FROM unnest($1::bigint[], $2::bigint[]) AS r(id, token)
WHERE d.id = r.id AND d.lease_token = r.token AND d.status = 'pending';

-- name: list_deliveries
SELECT d.id, d.event_seq, e.id AS event_id, d.listener, d.status, d.attempts, d.created_at,
       d.due_at, d.delivered_at, d.dead_reason, d.last_error, d.lease_owner, d.lease_until,
       d.claimed_via, d.updated_at
FROM deliveries d JOIN events e ON e.seq = d.event_seq
WHERE ($1::text IS NULL OR d.listener = $1::text)
  AND ($2::text IS NULL OR d.status = $2::text)
  AND ($3::bigint IS NULL OR d.id < $3::bigint)
ORDER BY d.id DESC
LIMIT $4::int;

-- name: get_delivery
SELECT d.id, d.event_seq, e.id AS event_id, d.listener, d.status, d.attempts, d.created_at,
       d.due_at, d.delivered_at, d.dead_reason, d.last_error, d.lease_owner, d.lease_until,
       d.claimed_via, d.updated_at
FROM deliveries d JOIN events e ON e.seq = d.event_seq
WHERE d.id = $1;

-- name: get_delivery_attempts
SELECT attempt, pod_id, started_at, duration_ms, outcome, status_code, error, response_body
FROM delivery_attempts WHERE delivery_id = $1 ORDER BY id;

-- name: redeliver_delivery
-- A dead or delivered row becomes pending and due now. created_at restarts so the
-- retention window counts from the redelivery (attempt numbers keep counting).
UPDATE deliveries
SET status = 'pending', due_at = clock_timestamp(), created_at = clock_timestamp(),
    dead_reason = NULL, delivered_at = NULL, last_error = NULL,
    lease_owner = NULL, lease_until = NULL, lease_token = NULL, updated_at = clock_timestamp()
WHERE id = $1 AND status IN ('dead', 'delivered')
RETURNING id, listener;

-- name: delivery_status
SELECT status FROM deliveries WHERE id = $1;
