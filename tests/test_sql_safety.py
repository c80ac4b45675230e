"""SQL injection guard: every statement the service sends is a fixed text with $n parameters.

A static check over the package's source (ast): the SQL argument of every asyncpg call is
a named query (``Q["..."]``), a plain string literal, or a name bound to one; an f-string,
``%``/``.format`` or ``+`` building SQL is refused unless every interpolated value goes
through ``quote_ident`` (channel and database names used as identifiers). Plus a live
check that an identifier with quotes and spaces round-trips through quote_ident.
"""

from __future__ import annotations

import ast
from pathlib import Path

import relay_trio
from relay_trio.db import quote_ident

SQL_METHODS = {"execute", "executemany", "fetch", "fetchrow", "fetchval", "prepare", "cursor",
               "copy_from_query", "admin_execute_sync", "admin_fetchval_sync"}
PACKAGE = Path(relay_trio.__file__).parent


def _interpolates_only_quoted(node: ast.JoinedStr) -> bool:
    for part in node.values:
        if isinstance(part, ast.FormattedValue):
            v = part.value
            if not (isinstance(v, ast.Call) and getattr(v.func, "id", getattr(v.func, "attr", "")) == "quote_ident"):
                return False
    return True


def unsafe_sql_calls(source: str, filename: str) -> list[str]:
    tree = ast.parse(source, filename)
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
        if name not in SQL_METHODS:
            continue
        args = node.args[1:] if name.startswith("admin_") else node.args
        if not args:
            continue
        sql = args[0]
        bad = False
        if isinstance(sql, ast.JoinedStr):
            bad = not _interpolates_only_quoted(sql)
        elif isinstance(sql, ast.BinOp):  # "..." + x, "..." % x
            bad = True
        elif isinstance(sql, ast.Call) and getattr(sql.func, "attr", "") == "format":
            bad = True
        if bad:
            problems.append(f"{filename}:{node.lineno}: {ast.unparse(node)[:120]}")
    return problems


def test_no_sql_is_built_from_values():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        problems += unsafe_sql_calls(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not problems, "SQL built from values (use $n parameters or quote_ident):\n" + "\n".join(problems)


def test_the_checker_catches_interpolation():
    bad = '''
async def op(conn, name, n):
    await conn.execute(f"SELECT * FROM t WHERE name = '{name}'")
    await conn.fetch("SELECT * FROM t WHERE n = " + str(n))
    await conn.fetchval("SELECT %s" % n)
    await conn.fetchrow("SELECT {}".format(n))
'''
    good = '''
async def op(conn, channel, n):
    await conn.execute(f"LISTEN {quote_ident(channel)}")
    await conn.fetch(Q["claim_due"], n)
    await conn.fetchval("SELECT $1::int", n)
'''
    assert len(unsafe_sql_calls(bad, "bad.py")) == 4
    assert unsafe_sql_calls(good, "good.py") == []


def test_query_files_use_parameters_not_placeholders_for_values():
    from relay_trio.queries import Q

    for name, text in Q.items():
        assert "%s" not in text and "{" not in text.replace("'{}'", ""), (name, text[:200])


async def test_hostile_identifier_round_trips_through_quote_ident(db):
    name = 'relay "chan"; DROP TABLE events; --'

    async def op(conn):
        await conn.execute(f"LISTEN {quote_ident(name)}")
        channels = await conn.fetch("SELECT pg_listening_channels() AS c")
        await conn.execute(f"UNLISTEN {quote_ident(name)}")
        return [r["c"] for r in channels], await conn.fetchval("SELECT to_regclass('events') IS NOT NULL")

    channels, events_table_exists = await db.run(op)
    assert name in channels
    assert events_table_exists
