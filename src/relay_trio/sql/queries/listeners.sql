-- The listener registry. Secrets are read only by the delivery side (registry cache);
-- the HTTP listing queries never select them.

-- name: listener_upsert
-- (xmax = 0) is true only for a freshly inserted row: create vs update in one statement,
-- race-free. On update the secret changes only when the client sent one ($6), enabled
-- only when sent ($4 NULL = keep), and the stream token is never replaced.
INSERT INTO listeners AS l (name, url, secret, enabled, stream_token_hash)
VALUES ($1, $2, $3, coalesce($4::boolean, true), $5)
ON CONFLICT (name) DO UPDATE
    SET url = EXCLUDED.url,
        secret = CASE WHEN $6::boolean THEN EXCLUDED.secret ELSE l.secret END,
        enabled = coalesce($4::boolean, l.enabled),
        disabled_reason = CASE WHEN coalesce($4::boolean, l.enabled) THEN NULL ELSE l.disabled_reason END,
        updated_at = now()
RETURNING (xmax = 0) AS created, name, url, enabled, disabled_reason, consecutive_failures,
          backoff_level, paused_until, created_at, updated_at, stream_token_hash IS NOT NULL AS has_stream_token;

-- name: listener_get_public
SELECT name, url, enabled, disabled_reason, consecutive_failures, backoff_level, paused_until,
       created_at, updated_at, stream_token_hash IS NOT NULL AS has_stream_token
FROM listeners WHERE name = $1;

-- name: listener_list_public
SELECT name, url, enabled, disabled_reason, consecutive_failures, backoff_level, paused_until,
       created_at, updated_at, stream_token_hash IS NOT NULL AS has_stream_token
FROM listeners ORDER BY name LIMIT $1;

-- name: listener_delete
DELETE FROM listeners WHERE name = $1 RETURNING name;

-- name: deliveries_dead_for_listener
-- Pending rows of a deleted listener end dead; clearing the lease token makes any
-- in-flight completion (which presents its fencing token) a no-op.
UPDATE deliveries
SET status = 'dead', dead_reason = 'listener_deleted', lease_owner = NULL, lease_until = NULL,
    lease_token = NULL, updated_at = clock_timestamp()
WHERE listener = $1 AND status = 'pending';

-- name: listeners_enabled_for_cache
SELECT name, url, secret, enabled, paused_until, updated_at FROM listeners WHERE enabled ORDER BY name;
