# Stopping processes a script started (sourced by scripts/lib/postgres.sh and bench/ scripts).

# stop_process PID [TENTHS]: asks PID to stop (SIGINT), and kills it (SIGKILL) if it is still
# there after TENTHS tenths of a second (default 50). A PID that is empty or already gone, or
# that goes while we wait, is simply done: this runs in cleanup traps, where that is normal.
stop_process() {
    local pid="$1" tenths="${2:-50}" i
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 0
    kill -INT "$pid" 2>/dev/null || return 0
    for ((i = 0; i < tenths; i++)); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || return 0
}
