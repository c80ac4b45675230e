-- Leased locks (relay_trio.store.locks). Expiry uses the database clock, never the pod's.

-- name: lock_acquire
-- Take the lock when it is free or its lease has expired. ON CONFLICT locks the existing
-- row and re-checks the WHERE on its newest version, so of two contenders exactly one wins.
INSERT INTO locks (name, owner, token, expires_at, acquired_at)
VALUES ($1, $2, nextval('fencing_tokens'), now() + make_interval(secs => $3), now())
ON CONFLICT (name) DO UPDATE
    SET owner = EXCLUDED.owner,
        token = EXCLUDED.token,
        expires_at = EXCLUDED.expires_at,
        acquired_at = EXCLUDED.acquired_at
    WHERE locks.expires_at <= now()
RETURNING name, owner, token, expires_at;

-- name: lock_renew
-- Only the current holder (owner AND fencing token) of a lease that has not expired.
UPDATE locks
   SET expires_at = now() + make_interval(secs => $4)
 WHERE name = $1 AND owner = $2 AND token = $3 AND expires_at > now()
RETURNING name, owner, token, expires_at;

-- name: lock_release
DELETE FROM locks
 WHERE name = $1 AND owner = $2 AND token = $3
RETURNING name;
