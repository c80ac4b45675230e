"""Finish reading a request body the handler never read, so keep-alive stays sound.

Handlers reject early on purpose: a bad token (401) or a bad listener name (400) is
answered before the body is read, so nobody spends memory on an unauthenticated body.
But hypercorn (0.18, h11) recycles a keep-alive connection only once both sides are done;
when the response completes before the unread body has been consumed, the *next* request
on that connection can hang until the client's timeout (measured: 1 in 2-4 requests after
an early 400 with a 2-byte body). So after every response we drain what is left of the body
(bounded: the app's MAX_CONTENT_LENGTH and ``DRAIN_SECONDS``); when that is not possible
(over the limit, too slow) the response says ``Connection: close`` so the client opens a
fresh connection instead of waiting on a stuck one.
"""

from __future__ import annotations

import trio
from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

DRAIN_SECONDS = 2.0


async def drain_unread_body(response: Response) -> Response:
    body = getattr(request, "body", None)
    if body is None:
        return response
    complete = body._complete.is_set()
    over_limit = body._must_raise is not None
    if not complete and not over_limit:
        with trio.move_on_after(DRAIN_SECONDS):
            try:
                async for _chunk in body:  # each chunk is dropped as it arrives
                    pass
            except HTTPException:  # over MAX_CONTENT_LENGTH while streaming
                pass
        complete = body._complete.is_set()
        over_limit = body._must_raise is not None
    if not complete or over_limit:
        response.headers["Connection"] = "close"
    return response


def install(app: Quart) -> None:
    app.after_request(drain_unread_body)
