-- Pull streams and consumer offsets (relay_trio.store.offsets).

-- name: offset_save
-- Monotonic: an equal value is a no-op success, a lower one updates nothing (the caller
-- then reports the current offset). ON CONFLICT locks the row, so concurrent saves serialize.
INSERT INTO consumer_offsets (listener, seq, updated_at)
VALUES ($1, $2, now())
ON CONFLICT (listener) DO UPDATE
    SET seq = EXCLUDED.seq, updated_at = EXCLUDED.updated_at
    WHERE consumer_offsets.seq <= EXCLUDED.seq
RETURNING seq;

-- name: offset_read
SELECT seq FROM consumer_offsets WHERE listener = $1;

-- name: stream_read
-- Events mentioning listener $1 after seq $2, in seq order, but only those whose
-- transaction is older than every transaction still running: seq and txid are assigned
-- together (0001_init.sql), so a lower seq that has not committed yet holds back every
-- higher one instead of being skipped forever once the cursor passed it.
SELECT seq, id, channel, author, content, mentions, meta::text AS meta, accepted_at
  FROM events
 WHERE mentions @> ARRAY[$1::text]
   AND seq > $2
   AND txid < pg_snapshot_xmin(pg_current_snapshot())
 ORDER BY seq
 LIMIT $3;

-- name: stream_listener
SELECT name, stream_token_hash FROM listeners WHERE name = $1;
