"""Named SQL queries, loaded from ``relay_trio/sql/queries/*.sql``.

Each file holds several queries, each introduced by a ``-- name: <query_name>`` line
(procrastinate-style). Query names are unique across files; ``Q["claim_due"]`` is the text.
"""

from __future__ import annotations

import re
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def _load() -> dict[str, str]:
    out: dict[str, str] = {}
    folder = resources.files("relay_trio") / "sql" / "queries"
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        text = entry.read_text()
        parts = _NAME.split(text)
        # parts = [preamble, name1, body1, name2, body2, ...]
        for name, body in zip(parts[1::2], parts[2::2]):
            if name in out:
                raise RuntimeError(f"query {name!r} defined twice (in {entry.name})")
            out[name] = body.strip()
    return out


class _Queries(dict[str, str]):
    def __missing__(self, key: str) -> str:
        raise KeyError(f"no SQL query named {key!r} in relay_trio/sql/queries/*.sql")


Q: dict[str, str] = _Queries(_load())
