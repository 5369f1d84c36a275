#!/usr/bin/env bash
# Instructions the gateway executes per streamed chat request, counted by callgrind: a count,
# not a time, so the noise of a shared machine does not move it. Compares builds.
#
#   scripts/callgrind-hop.sh BIN [BIN...]      e.g. scripts/callgrind-hop.sh /tmp/fg-before /tmp/fg-after
#
# For each build: `fleetgate serve` under `valgrind --tool=callgrind` (all threads), a
# zero-delay sim (the first build's `sim`), a key, then N_LOW and N_HIGH streamed chats (8
# tokens, one after another, through curl); the instructions per request are the difference of
# the two totals over N_HIGH - N_LOW, so start-up and shutdown cancel out. Each build is run
# twice, alternating. Environment: N_LOW (default 50), N_HIGH (default 850), PORT (18801),
# SIM_PORT (18701), SIMS (1: the pool's backends, sims on SIM_PORT, SIM_PORT+1, ...; a pool of
# two or more keeps what resuming a stream needs, `[pools.resume]`), POOL_TOML (tables added to
# the pool, e.g. POOL_TOML=$'[pools.affinity]\nby = "longest_prefix"').
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 BIN [BIN...]" >&2; exit 64; }
command -v valgrind >/dev/null || { echo "valgrind is not installed (Debian's valgrind)" >&2; exit 69; }
N_LOW=${N_LOW:-50} N_HIGH=${N_HIGH:-850} PORT=${PORT:-18801} SIM_PORT=${SIM_PORT:-18701}
SIMS=${SIMS:-1}
WORK=$(mktemp -d /tmp/callgrind-hop.XXXXXX)
SIM_PIDS=()
BACKENDS=""
trap 'kill "${SIM_PIDS[@]}" 2>/dev/null; rm -rf "$WORK"' EXIT
for i in $(seq 0 $((SIMS - 1))); do
    port=$((SIM_PORT + i))
    "$1" sim --port "$port" --zero-delay >"$WORK/sim$i.log" 2>&1 &
    SIM_PIDS+=($!)
    BACKENDS="$BACKENDS${BACKENDS:+, }\"http://127.0.0.1:$port\""
    for _ in $(seq 1 50); do curl -sf -o /dev/null "http://127.0.0.1:$port/health" && break; sleep 0.1; done
done

# total BIN N: callgrind's instruction total for `serve` over N requests
total() {
    local bin=$1 n=$2 dir
    dir=$(mktemp -d "$WORK/run.XXXXXX")
    cat >"$dir/gw.toml" <<T
[server]
listen = "127.0.0.1:$PORT"
log_format = "text"
request_log_events = false
health_interval_ms = 60000
[request_log]
enabled = false
spill_path = "$dir/spill"
[database]
sqlite_path = "$dir/db"
[admin]
listen = ""
[[pools]]
model = "qwen32b"
backends = [$BACKENDS]
max_in_flight_per_backend = 0
${POOL_TOML:-}
T
    local key vpid
    key=$("$bin" keys --config "$dir/gw.toml" create --env prod --name cg --json 2>/dev/null |
        grep -oE '"key": *"[^"]+"' | head -n1 | sed -E 's/.*"key": *"([^"]+)"/\1/')
    valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" "$bin" serve --config "$dir/gw.toml" >"$dir/gw.log" 2>&1 &
    vpid=$!
    for _ in $(seq 1 120); do curl -sf -o /dev/null "http://127.0.0.1:$PORT/health" && break; sleep 1; done
    local body='{"model":"qwen32b","stream":true,"max_tokens":8,"messages":[{"role":"user","content":"hello there"}]}'
    for _ in $(seq 1 "$n"); do
        curl -sf -o /dev/null -H "authorization: Bearer $key" -H content-type:application/json \
            -d "$body" "http://127.0.0.1:$PORT/v1/chat/completions" || { echo "a request failed" >&2; exit 1; }
    done
    kill -INT "$vpid"
    wait "$vpid" 2>/dev/null || true
    grep -E '^totals:' "$dir/cg.out" | awk '{print $2}'
}

echo "| build | run | instructions, $N_LOW requests | $N_HIGH requests | per request |"
echo "|---|---|---|---|---|"
for run in 1 2; do
    for bin in "$@"; do
        low=$(total "$bin" "$N_LOW")
        high=$(total "$bin" "$N_HIGH")
        echo "| $bin | $run | $low | $high | $(( (high - low) / (N_HIGH - N_LOW) )) |"
    done
done
