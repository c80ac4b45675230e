-- Operations: lag gauges and the shutdown lease release.

-- name: ops_oldest_pending_by_listener
-- One row per registered listener: the age of its oldest pending row (NULL when none).
-- A LATERAL index probe per listener (deliveries_listener_status), so the cost grows with
-- the number of listeners, not with the backlog.
SELECT l.name AS listener,
       EXTRACT(EPOCH FROM (clock_timestamp() - d.created_at))::float8 AS age_seconds
FROM listeners AS l
LEFT JOIN LATERAL (
    SELECT created_at
    FROM deliveries
    WHERE listener = l.name AND status = 'pending'
    ORDER BY id
    LIMIT 1
) AS d ON true;

-- name: ops_release_pod_leases
-- Release every lease $1 (a pod id) still holds: the rows become claimable at once, and
-- the cleared fencing token keeps any late result of the old claim from completing them.
UPDATE deliveries
SET lease_owner = NULL,
    lease_until = NULL,
    lease_token = NULL,
    due_at = LEAST(due_at, clock_timestamp()),
    updated_at = clock_timestamp()
WHERE status = 'pending' AND lease_owner = $1
RETURNING listener;
