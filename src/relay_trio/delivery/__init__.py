"""Push delivery: claims, one bounded delivery nursery, signed POSTs, retries, dead letters.

  loop.py         run_delivery_loop (hand-off / notify / poll -> claims -> deliveries) and
                  the pod component
  pg_store.py     the loop's store on PostgreSQL (relay_trio.store.claims through db.run)
  sender.py       one attempt: body, signed headers, POST under a trio deadline, outcome
  signing.py      Standard Webhooks signatures
  schedule.py     retry backoff with jitter, Retry-After clamping, whole-listener backoff
  model.py        the values passed between them
  http_client.py  the pod's guarded httpx client (connect-time target checks)
"""
