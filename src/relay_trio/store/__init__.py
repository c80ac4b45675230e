"""The store: every read and write of relay state, as asyncio-side functions.

Shape: *caller-owned transaction handle*. A function named ``*_tx`` takes the asyncpg
connection of a transaction the caller opened (``Database.run_tx``), so the caller composes
several writes into one transaction and one trio->asyncio crossing. Functions without the
suffix are whole operations with their own transaction, exposed to trio through
``Database.run``. SQL text lives in ``relay_trio/sql/queries/*.sql`` (``relay_trio.queries.Q``).

Modules:
  events     insert_event_tx, enqueue_tx, notify_tx (intake)
  listeners  the registry (create/update/delete/list/get)
  claims     claim_due, claim_by_id, complete, retry, release, dead-letter (delivery)
  offsets    save_offset_tx, read_offset, read_stream (settled rows only), stream auth lookup
  locks      acquire_lock(name, ttl, owner), renew_lock(lease, ttl), release_lock(lease):
             leases on the database clock, fencing tokens from the fencing_tokens sequence
  janitor    dead_letter_expired, prune_delivered_tx (one bounded batch per call)
"""
