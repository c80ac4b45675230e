-- The janitor's retention sweeps (relay_trio.store.janitor). Each statement touches at
-- most $2 rows, so a sweep is a series of short transactions that never hold many locks
-- and never block delivery (SKIP LOCKED: a row being claimed right now is left alone).

-- name: janitor_dead_letter_expired
-- Pending rows older than the delivery retention ($1 seconds) whose lease is not live:
-- nobody will deliver them any more. A leased row is left to its delivery, whose own
-- settlement applies the retention rule.
WITH doomed AS (
    SELECT id
      FROM deliveries
     WHERE status = 'pending'
       AND created_at < clock_timestamp() - make_interval(secs => $1::float8)
       AND (lease_until IS NULL OR lease_until <= clock_timestamp())
     ORDER BY id
     LIMIT $2::int
       FOR UPDATE SKIP LOCKED
)
UPDATE deliveries d
   SET status = 'dead',
       dead_reason = 'retention',
       lease_owner = NULL, lease_until = NULL, lease_token = NULL,
       updated_at = clock_timestamp()
  FROM doomed
 WHERE d.id = doomed.id
RETURNING d.id;

-- name: janitor_lock_old_delivered
-- Delivered rows older than the delivered retention ($1 seconds), locked for pruning.
SELECT id
  FROM deliveries
 WHERE status = 'delivered'
   AND delivered_at < clock_timestamp() - make_interval(secs => $1::float8)
 ORDER BY id
 LIMIT $2::int
   FOR UPDATE SKIP LOCKED;

-- name: janitor_delete_attempts
DELETE FROM delivery_attempts WHERE delivery_id = ANY($1::bigint[]);

-- name: janitor_delete_deliveries
DELETE FROM deliveries WHERE id = ANY($1::bigint[]);
