-- Queries of the LISTEN/NOTIFY listener's dedicated connection (relay_trio.pglistener).
-- LISTEN itself takes an identifier, not a parameter: see relay_trio/store/listen.py.

-- name: listener_notify
SELECT pg_notify($1, $2)

-- name: listener_listening_channels
SELECT coalesce(array_agg(c ORDER BY c), '{}') FROM pg_listening_channels() AS c
