# Sourced by scripts/serve and scripts/test: make sure this checkout has what it needs.
#  - a Python 3.11-3.13 virtualenv in .venv with the package installed (extras in $RELAY_EXTRAS)
#  - PostgreSQL server binaries for the embedded cluster (installed with apt-get when missing and root)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

pick_python() {
    for candidate in "${PYTHON:-}" python3.13 python3.12 python3.11 python3; do
        [ -n "$candidate" ] || continue
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" - <<'PY' 2>/dev/null
import sys
raise SystemExit(0 if (3, 11) <= sys.version_info[:2] < (3, 14) else 1)
PY
        then
            command -v "$candidate"
            return 0
        fi
    done
    echo "relay-trio needs Python 3.11, 3.12 or 3.13 (trio-asyncio 0.16 does not run on 3.14); set PYTHON=/path/to/python" >&2
    return 1
}

ensure_venv() {
    local extras="${RELAY_EXTRAS:-}"
    local spec="."
    [ -n "$extras" ] && spec=".[$extras]"
    local stamp_want
    stamp_want="$(cat pyproject.toml | sha256sum | cut -c1-16)-$extras"
    if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys' >/dev/null 2>&1; then
        rm -rf .venv
        "$(pick_python)" -m venv .venv
    fi
    if [ "$(cat .venv/.relay-stamp 2>/dev/null || true)" != "$stamp_want" ]; then
        echo "==> installing relay-trio${extras:+ [$extras]} into .venv" >&2
        if ! .venv/bin/python -m pip install --disable-pip-version-check --upgrade pip > .venv/pip.log 2>&1 \
            || ! .venv/bin/python -m pip install --disable-pip-version-check -e "$spec" >> .venv/pip.log 2>&1; then
            tail -40 .venv/pip.log >&2
            echo "error: installing relay-trio into .venv failed (full log: .venv/pip.log)" >&2
            return 1
        fi
        .venv/bin/python -c 'import relay_trio, trio_asyncio, asyncpg, quart_trio' >/dev/null
        if [ "$extras" = "test" ]; then
            .venv/bin/python -c 'import pytest, pytest_trio, hypothesis, standardwebhooks' >/dev/null
        fi
        echo "$stamp_want" > .venv/.relay-stamp
    fi
}

ensure_postgres_binaries() {
    if [ -n "${RELAY_DATABASE_URL:-}" ] && [ "${RELAY_NEED_PG_BINARIES:-0}" != "1" ]; then
        return 0
    fi
    if .venv/bin/python -c 'from relay_trio.embedded_pg import find_bindir; find_bindir()' >/dev/null 2>&1; then
        return 0
    fi
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "==> installing PostgreSQL server binaries (apt-get install postgresql)" >&2
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
    else
        echo "warning: PostgreSQL server binaries not found; install your distribution's 'postgresql' package" >&2
    fi
}
