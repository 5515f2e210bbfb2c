# Sourced by the experiment scripts: start `ferry up` on loopback ports with the given flags, its
# output in LOG, and wait (up to 2 minutes) for it to print `ready router=ADDR`.
# Sets UP_PID and ROUTER, and exports FERRY_ADMIN_TOKEN (the cluster's admin token, which `ferry
# bench serve` reads to record the workers' step time); exits the script if the cluster does not
# come up.
# Usage: up_cluster FERRY LOG [ferry up flags...]; later: down_cluster
up_cluster() {
    local ferry="$1" log="$2"; shift 2
    "$ferry" up --listen 127.0.0.1:0 --http 127.0.0.1:0 "$@" > "$log" 2>&1 &
    UP_PID=$!
    ROUTER=""
    for _ in $(seq 1 600); do
        ROUTER="$(grep -o 'ready router=[0-9.:]*' "$log" | cut -d= -f2 || true)"
        if [ -n "$ROUTER" ]; then
            local token_file
            token_file="$(grep -o 'token_file=[^ ]*' "$log" | head -n1 | cut -d= -f2 || true)"
            if [ -n "$token_file" ] && [ -r "$token_file" ]; then
                FERRY_ADMIN_TOKEN="$(cat "$token_file")"
                export FERRY_ADMIN_TOKEN
            fi
            return 0
        fi
        sleep 0.2
    done
    echo "the cluster did not start (see $log)" >&2
    kill "$UP_PID"
    exit 1
}

# Stop the cluster up_cluster started, or the clusters whose UP_PIDs are given, all at once
# (SIGTERM: their workers drain and exit).
# Usage: down_cluster [UP_PID...]
down_cluster() {
    local pids=("$@")
    [ ${#pids[@]} -gt 0 ] || pids=("$UP_PID")
    kill -TERM "${pids[@]}"
    for pid in "${pids[@]}"; do wait "$pid" || true; done
}
