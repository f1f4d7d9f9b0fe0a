# Sourced by scripts/test and bench/*: starts and stops a throwaway PostgreSQL on loopback.
#   pg_start WORK_DIR   -> sets PG_URL (admin URL), PG_PID, PG_BIN
#   pg_stop
# Tests run the server without durability (fsync, synchronous commit and full-page writes off):
# a crash of a throwaway cluster loses nothing anyone needs. Benchmarks set PG_DURABLE=1 to get
# PostgreSQL's defaults for those three, so that their figures are what a real server would do.
# Installs the 'postgresql' package with apt-get when no server binaries are found (as root).

. "$(dirname "${BASH_SOURCE[0]}")/process.sh"

_pg_log() { printf '[postgres] %s\n' "$*" >&2; }

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

_pg_find_bin() {
    PG_BIN=""
    local dir
    for dir in /usr/lib/postgresql/*/bin /usr/pgsql-*/bin /usr/local/pgsql/bin; do
        if [[ -x "$dir/initdb" ]]; then PG_BIN="$dir"; fi
    done
    if [[ -z "$PG_BIN" ]] && command -v initdb >/dev/null; then PG_BIN="$(dirname "$(command -v initdb)")"; fi
}

pg_start() {
    local work="$1"
    _pg_find_bin
    if [[ -z "$PG_BIN" ]]; then
        _pg_log "PostgreSQL server binaries not found; installing the 'postgresql' package"
        if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
            _pg_log "error: need PostgreSQL server binaries (initdb, postgres, pg_isready): install the 'postgresql' package and re-run"
            return 1
        fi
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
        _pg_find_bin
        [[ -n "$PG_BIN" ]] || { _pg_log "error: apt-get installed postgresql but no initdb was found"; return 1; }
    fi
    # initdb refuses to run as root: run the server as 'postgres' in a directory it owns.
    local as_pg=()
    mkdir -p "$work/pg"
    if [[ $(id -u) -eq 0 ]]; then
        id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
        chown postgres "$work/pg"
        chmod 755 "$work"
        as_pg=(runuser -u postgres --)
    fi
    local port
    port="$(free_port)"
    _pg_log "starting $PG_BIN/postgres on 127.0.0.1:$port"
    "${as_pg[@]}" "$PG_BIN/initdb" -D "$work/pg/data" -U postgres --auth=trust -E UTF8 --locale=C \
        >"$work/pg/initdb.log" 2>&1 || { cat "$work/pg/initdb.log" >&2; return 1; }
    local durability=(-c fsync=off -c synchronous_commit=off -c full_page_writes=off)
    if [[ "${PG_DURABLE:-0}" == 1 ]]; then
        durability=(-c fsync=on -c synchronous_commit=on -c full_page_writes=on)
    fi
    _pg_log "durability: ${durability[*]}"
    "${as_pg[@]}" "$PG_BIN/postgres" -D "$work/pg/data" -h 127.0.0.1 -p "$port" -k "$work/pg" \
        "${durability[@]}" -c max_connections=300 \
        >"$work/pg/postgres.log" 2>&1 &
    PG_PID=$!
    # Stopped by pg_stop; bash need not report its end as a killed job.
    disown "$PG_PID" 2>/dev/null || true
    local _
    for _ in $(seq 1 150); do
        "$PG_BIN/pg_isready" -h 127.0.0.1 -p "$port" -q 2>/dev/null && break
        kill -0 "$PG_PID" 2>/dev/null || { cat "$work/pg/postgres.log" >&2; return 1; }
        sleep 0.1
    done
    "$PG_BIN/pg_isready" -h 127.0.0.1 -p "$port" -q || { _pg_log "error: not ready"; return 1; }
    PG_URL="postgres://postgres@127.0.0.1:$port/postgres"
    PG_DATA="$work/pg/data"
    export PG_URL PG_PID PG_BIN PG_DATA
}

# Signals the postmaster itself (its PID is the first line of postmaster.pid): as root, PG_PID
# is runuser's, which does not pass SIGINT on, and killing it would orphan the server.
pg_stop() {
    [[ -n "${PG_PID:-}" ]] || return 0
    local server="$PG_PID"
    if [[ -r "${PG_DATA:-}/postmaster.pid" ]]; then
        server="$(head -n 1 "$PG_DATA/postmaster.pid")"
    fi
    stop_process "$server"
    stop_process "$PG_PID" 0
    PG_PID=""
}

# Creates an empty database next to the admin one and prints its URL.
pg_create_db() {
    local name="$1"
    "$PG_BIN/psql" -q "$PG_URL" -c "DROP DATABASE IF EXISTS $name" -c "CREATE DATABASE $name" >/dev/null
    echo "${PG_URL%/*}/$name"
}
