-- Intake: the event insert and its outbox rows, in one statement.
--
-- The event INSERT is the first write of the transaction (its trigger assigns seq and
-- txid together; pull streams depend on it). ON CONFLICT (id) DO NOTHING makes a
-- concurrent duplicate wait for the first writer's COMMIT and then insert nothing, so
-- twenty racing POSTs of one id end as one event and one set of rows.
-- Mentions are resolved against ENABLED listeners; one outbox row per resolved name.

-- name: insert_event_with_outbox
WITH ev AS (
    INSERT INTO events (id, channel, author, content, mentions, meta, body_hash)
    VALUES ($1, $2, $3, $4, $5::text[], $6::jsonb, $7)
    ON CONFLICT (id) DO NOTHING
    RETURNING seq, accepted_at
), targets AS (
    -- FOR KEY SHARE: a concurrent DELETE /listeners waits for this commit and then
    -- dead-letters these rows too (otherwise it could miss them, and a listener later
    -- re-created under the same name would receive them).
    SELECT l.name FROM listeners l WHERE l.name = ANY ($5::text[]) AND l.enabled FOR KEY SHARE
), outbox AS (
    INSERT INTO deliveries (event_seq, listener)
    SELECT ev.seq, targets.name FROM ev CROSS JOIN targets
    ORDER BY targets.name
    RETURNING id, listener
)
SELECT ev.seq,
       ev.accepted_at,
       coalesce((SELECT array_agg(outbox.listener ORDER BY outbox.id) FROM outbox), '{}'::text[]) AS listeners,
       coalesce((SELECT array_agg(outbox.id ORDER BY outbox.id) FROM outbox), '{}'::bigint[]) AS delivery_ids
FROM ev;

-- name: store_event_response
UPDATE events SET response = $2::jsonb WHERE seq = $1;

-- name: get_event_for_replay
SELECT seq, body_hash, response FROM events WHERE id = $1;

-- name: pg_notify
SELECT pg_notify($1, $2);

-- name: enqueue_outbox
INSERT INTO deliveries (event_seq, listener)
SELECT $1, l.name FROM listeners l WHERE l.name = ANY ($2::text[]) AND l.enabled
ORDER BY l.name
FOR KEY SHARE OF l
RETURNING listener, id;
