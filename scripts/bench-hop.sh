#!/usr/bin/env bash
# Reproduces the hop-cost benchmark of docs/benchmarks.md in one command:
#   scripts/bench-hop.sh [driver flags...]      e.g. scripts/bench-hop.sh --rounds 500
#
# Installs Debian's nginx if it is missing, builds fleetgate in release mode and starts, on
# 127.0.0.1 only:
#   - a zero-delay sim (model qwen32b): the main pass, phases 1-2;
#   - a slow sim (model slow): phase 3, streams that stay open;
#   - a burst sim (model burst, first token on arrival, then one every 500 ms, no prefill
#     queue): phase 0 (`--phases burst`: bursts of 5000 streams opened at once through each
#     proxy and directly, cold then warm, with the RSS after each; run it first, e.g.
#     `--phases burst,latency,memory`);
#   - a paced sim (model paced, one token per ~2 ms step): the second pass, phases 1-2 with
#     tokens arriving one by one (skip with PACED=0);
#   - fleetgate in front of all four (one pool per model) and nginx in front of all four
#     (one port per sim).
# Then it runs the driver (benches/hop/), then the not-streamed throughput pass (wrk, closed
# loop; THROUGHPUT=0 skips it), stops everything it started, and leaves the JSON and
# markdown under bench-out/hop-<UTC time>/ (bench-out/ is git-ignored), also copied to
# bench-out/hop-latest.{md,json}. The markdown summary is printed at the end. Flags given to the
# script go to the main pass of the driver.
#
# Environment:
#   GATEWAY_WORKERS      request-path worker threads of the gateway (server.workers; default 0 =
#                        one per core)
#   GATEWAY_THREADS      tokio worker threads of the gateway's control plane (default: tokio's)
#   RESUMABLE            1: the memory phase's pool (slow) lists its sim twice (as 127.0.0.1
#                        and as localhost), so its streams keep what resuming a stream on
#                        another backend needs ([pools.resume]: the text so far); default 0
#   REQUEST_LOG          1: the request log on, as shipped (SQLite store); default 0, like
#                        nginx's access_log off
#   NGINX_WORKERS        nginx worker_processes (default 1, see docs/benchmarks.md)
#   SIM_FLAGS            timing flags of the main-pass sim (default --zero-delay)
#   PACED                1 (default) runs the paced pass, 0 skips it
#   PACED_ARGS           driver flags of the paced pass (default below); e.g. the streamed-CPU
#                        case: PACED_STEP_MS=10 PACED_ARGS="--rate 100 --rounds 30
#                        --warmup-rounds 5 --slice-secs 5 --repeats 3"
#   PACED_STEP_MS        the paced sim's decode step in ms (default 1: ~2 ms per token with the
#                        timer's granularity)
#   THROUGHPUT           1 (default) runs the not-streamed throughput pass with wrk (installed
#                        from Debian when missing), 0 skips it; TP_CONNECTIONS (64),
#                        TP_SECS_EACH (5), TP_ROUNDS (2) shape it
#   FLEETGATE_BENCH_KEY  API key the driver sends (default: one created in the run's own store)
#   GATEWAY_TOML         extra top-level TOML for the gateway (e.g. a [limits] section with
#                        shared = "redis"), placed before the pools
#   POOL_TOML            extra TOML for the main pass's pool (qwen32b), e.g. a [pools.affinity]
#                        table: prefix sharing across replicas is measured with by = "longest_prefix"
#                        and GATEWAY_TOML's shared limits, against the same without Redis
#   TRACING              1: OpenTelemetry on at a 100 % sample (sampler always_on), every span
#                        exported over OTLP/HTTP to a local sink (scripts/otlp-sink.py, which
#                        answers 200); default 0, tracing off as shipped
#   FLEETGATE_BIN        the fleetgate binary to measure (default: this checkout's, built
#                        first); e.g. an earlier commit's for a before/after comparison
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
RUN_DIR="$ROOT/bench-out/hop-$STAMP"
NGINX_WORKERS=${NGINX_WORKERS:-1}
SIM_FLAGS=${SIM_FLAGS:---zero-delay}
PACED=${PACED:-1}
THROUGHPUT=${THROUGHPUT:-1}
TP_CONNECTIONS=${TP_CONNECTIONS:-64}
TP_SECS_EACH=${TP_SECS_EACH:-5}
TP_ROUNDS=${TP_ROUNDS:-2}
# 150 rounds of ~135 ms streams at concurrency 1 take about a minute per pass.
PACED_ARGS=${PACED_ARGS:---rounds 150 --warmup-rounds 10 --slice-secs 3}
PACED_STEP_MS=${PACED_STEP_MS:-1}
if [ "$PACED_STEP_MS" = 1 ]; then
    PACED_LABEL="paced sim (one token per ~2 ms step)"
else
    PACED_LABEL="paced sim (one token per $PACED_STEP_MS ms step)"
fi
# FLEETGATE_BIN: another build to measure (a before/after comparison); default this checkout's.
BIN=${FLEETGATE_BIN:-"$ROOT/target/release/fleetgate"}

SCRIPT_NAME=bench-hop
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"

# 5000 streams need ~10000 sockets in a proxy (client side + upstream side) and 5000 in the
# driver and the sim; every process started below inherits this limit: 65536 where the hard
# limit allows it, else the hard limit.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
NOFILE=$(ulimit -n)
[ "$NOFILE" -ge 12000 ] || die "open-file limit $NOFILE is too low for 5000 streams (need >= 12000)"

# --- nginx, wrk -------------------------------------------------------------------------------
find_nginx
if [ "$THROUGHPUT" = 1 ] && ! command -v wrk >/dev/null; then
    log "installing Debian's wrk"
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q wrk ||
        die "cannot install wrk (THROUGHPUT=0 skips its pass)"
fi

# --- build ------------------------------------------------------------------------------------
log "building (release)"
[ -n "${FLEETGATE_BIN:-}" ] || cargo build --release -q
cargo bench --bench hop --no-run -q 2>/dev/null || cargo bench --bench hop --no-run

# --- processes --------------------------------------------------------------------------------
TMP=$(mktemp -d /tmp/bench-hop.XXXXXX)
mkdir -p "$RUN_DIR" "$TMP/nginx"

cleanup() {
    stop_started
    mkdir -p "$RUN_DIR/logs"
    cp "$TMP"/*.log "$TMP"/*.toml "$TMP"/nginx/*.conf "$TMP"/nginx/*.log "$RUN_DIR/logs/" 2>/dev/null || true
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A port on 127.0.0.1 that no socket uses in any state (a connection's ephemeral port would make
# nginx's bind fail), for nginx (which cannot bind port 0 and report it), distinct from
# the ones already handed out.
TAKEN=" "
free_port() {
    local p
    for _ in $(seq 1 200); do
        p=$((20000 + RANDOM % 40000))
        case "$TAKEN" in *" $p "*) continue ;; esac
        if [ -z "$(ss -Htan "sport = :$p" 2>/dev/null)" ]; then
            TAKEN="$TAKEN$p "
            echo "$p"
            return 0
        fi
    done
    die "no free port found"
}

# Bounded readiness check over HTTP.
wait_http() {
    local url=$1 name=$2
    for _ in $(seq 1 100); do
        curl -sf -o /dev/null "$url" && return 0
        sleep 0.1
    done
    die "$name did not answer $url within 10 s"
}

# start_sim NAME MODEL FLAGS...: starts a sim on a free port; sets SIM_STARTED_PID/URL.
start_sim() {
    local name=$1 model=$2
    shift 2
    "$BIN" sim --host 127.0.0.1 --port 0 --served-model-name "$model" "$@" >"$TMP/$name.log" 2>&1 &
    SIM_STARTED_PID=$!
    STARTED+=("$SIM_STARTED_PID")
    SIM_STARTED_URL=$(wait_url "$TMP/$name.log" "$SIM_STARTED_PID" "$name")
}

export NO_COLOR=1 RUST_LOG=${RUST_LOG:-info}

log "starting the sims"
# shellcheck disable=SC2086 # SIM_FLAGS is a list of flags
start_sim sim qwen32b $SIM_FLAGS
SIM_PID=$SIM_STARTED_PID SIM_URL=$SIM_STARTED_URL
# Slow tokens so that streams stay open: one step every 200 ms for every running sequence, no
# per-sequence slowdown, room for all 5000 in the batch.
start_sim sim-slow slow --decode-step-ms 200 --decode-ms-per-seq 0 --prefill-us-per-token 0 \
    --max-num-seqs 10000 --max-num-batched-tokens 20000
SLOW_URL=$SIM_STARTED_URL
# The bursts' backend (phase 0): each stream's first token leaves the moment its request
# arrives, then a token every 500 ms to every running sequence, with room for all 5000 in one
# step's batch (no prefill queue): the backend adds nothing to a burst's TTFT, and a burst's
# streams all stay open together (20 tokens, 10 s). Burst directly too: the floor, the driver's
# own and the sim's connection handling. Idle kept-alive connections are closed after 5 s, as
# vLLM's server closes them.
start_sim sim-burst burst --first-token-at-once --decode-step-ms 500 --decode-ms-per-seq 0 \
    --prefill-us-per-token 0 --max-num-seqs 10000 --max-num-batched-tokens 1000000 \
    --timeout-keep-alive 5
BURST_PID=$SIM_STARTED_PID BURST_URL=$SIM_STARTED_URL
if [ "$PACED" = 1 ]; then
    # One token per scheduler step of 1 ms (about 2 ms with the timer's granularity): every
    # SSE frame arrives in its own read, as from a real server. Room for the ~60 streams that
    # 400 req/s keeps open, so the sim never queues.
    start_sim sim-paced paced --decode-step-ms "$PACED_STEP_MS" --decode-ms-per-seq 0 \
        --prefill-us-per-token 0 --max-num-seqs 256
    PACED_PID=$SIM_STARTED_PID PACED_URL=$SIM_STARTED_URL
else
    PACED_PID="" PACED_URL=$SIM_URL
fi

# TRACING=1: a collector that accepts every export, and a [tracing] section sampling everything.
TRACING_TOML=""
if [ "${TRACING:-0}" = 1 ]; then
    python3 "$ROOT/scripts/otlp-sink.py" >"$TMP/otlp-sink.log" 2>&1 &
    SINK_PID=$!
    STARTED+=("$SINK_PID")
    SINK_URL=$(wait_url "$TMP/otlp-sink.log" "$SINK_PID" "otlp-sink")
    TRACING_TOML=$(printf '[tracing]\nendpoint = "%s"\nsampler = "always_on"\nschedule_delay_ms = 1000\nmax_queue_size = 65536\nmax_export_batch_size = 512\n' "$SINK_URL")
fi

# Every client of this run is one address (the load generator on 127.0.0.1), and the memory
# phase holds 5000 connections: more than its default share (half of max_connections). A
# build from before the setting (FLEETGATE_BIN) has no share to raise.
PER_ADDRESS="max_connections_per_address = 12000"
printf '[server]\n%s\n[[pools]]\nmodel = "x"\nbackends = ["http://127.0.0.1:1"]\n' "$PER_ADDRESS" >"$TMP/per-address.toml"
"$BIN" check-config --config "$TMP/per-address.toml" >/dev/null 2>&1 || PER_ADDRESS=""

cat >"$TMP/fleetgate.toml" <<EOF
[server]
listen = "127.0.0.1:0"
log_format = "text"
request_log_events = false
shutdown_grace_seconds = 1
health_interval_ms = 5000
workers = ${GATEWAY_WORKERS:-0}
$PER_ADDRESS

# By default like nginx (access_log off): no request log (its cost per row is measured on its
# own by cargo bench --bench telemetry). REQUEST_LOG=1: as shipped, one row per request into
# the SQLite store above.
[request_log]
enabled = $([ "${REQUEST_LOG:-0}" = 1 ] && echo true || echo false)
spill_path = "$TMP/request-log.spill"

# A throw-away key store for this run; no admin listener (its default port is fixed).
[database]
sqlite_path = "$TMP/fleetgate.db"

[admin]
listen = ""

$(printf '%b' "${GATEWAY_TOML:-}")

$TRACING_TOML

# No backend capacity cap (max_in_flight_per_backend = 0): nginx has no admission control, and
# the memory phase holds 5000 streams on one sim. The admission path still runs (fast path).
[[pools]]
model = "qwen32b"
backends = ["$SIM_URL"]
max_in_flight_per_backend = 0
$(printf '%b' "${POOL_TOML:-}")

[[pools]]
model = "slow"
backends = ["$SLOW_URL"$([ "${RESUMABLE:-0}" = 1 ] && echo ", \"${SLOW_URL/127.0.0.1/localhost}\"")]
max_in_flight_per_backend = 0

[[pools]]
model = "burst"
backends = ["$BURST_URL"]
max_in_flight_per_backend = 0

[[pools]]
model = "paced"
backends = ["$PACED_URL"]
max_in_flight_per_backend = 0
EOF

# One key for the driver, sent to every target alike (the sim and nginx ignore it).
if [ -z "${FLEETGATE_BENCH_KEY:-}" ]; then
    FLEETGATE_BENCH_KEY=$("$BIN" keys --config "$TMP/fleetgate.toml" create --env prod --name hop-bench --json 2>"$TMP/keys.log" |
        grep -oE '"key": *"[^"]+"' | head -n1 | sed -E 's/.*"key": *"([^"]+)"/\1/' || true)
    [ -n "$FLEETGATE_BENCH_KEY" ] || { cat "$TMP/keys.log" >&2; die "could not create an API key"; }
fi
export FLEETGATE_BENCH_KEY

log "starting fleetgate"
if [ -n "${GATEWAY_THREADS:-}" ]; then
    TOKIO_WORKER_THREADS=$GATEWAY_THREADS "$BIN" serve --config "$TMP/fleetgate.toml" >"$TMP/fleetgate.log" 2>&1 &
else
    "$BIN" serve --config "$TMP/fleetgate.toml" >"$TMP/fleetgate.log" 2>&1 &
fi
GW_PID=$!
STARTED+=("$GW_PID")
GW_URL=$(wait_url "$TMP/fleetgate.log" "$GW_PID" "fleetgate")
wait_http "$GW_URL/healthz" fleetgate

NGINX_PORT=$(free_port)
NGINX_SLOW_PORT=$(free_port)
NGINX_PACED_PORT=$(free_port)
NGINX_BURST_PORT=$(free_port)
N="$TMP/nginx"
nginx_server() { # port upstream
    cat <<EOF
    server {
        listen 127.0.0.1:$1;
        location / {
            proxy_pass http://$2;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }
    }
EOF
}
nginx_upstream() { # name url
    cat <<EOF
    upstream $1 {
        server ${2#http://};
        keepalive 256;
        keepalive_requests 1000000;
    }
EOF
}
cat >"$N/nginx.conf" <<EOF
# Generated by scripts/bench-hop.sh: nginx as a plain streaming reverse proxy in front of the
# same sims, the floor for what a hop costs.
worker_processes $NGINX_WORKERS;
worker_rlimit_nofile $NOFILE;
daemon off;
master_process on;
pid $N/nginx.pid;
error_log $N/error.log warn;

events {
    worker_connections $((NOFILE - 64));
}

http {
    access_log off;
    client_body_temp_path $N/client_body;
    proxy_temp_path $N/proxy;
    tcp_nodelay on;
    keepalive_timeout 75s;
    # Like hyper, never close a keep-alive connection after a fixed number of requests.
    keepalive_requests 1000000;

$(nginx_upstream sim "$SIM_URL")
$(nginx_upstream slow "$SLOW_URL")
$(nginx_upstream paced "$PACED_URL")
$(nginx_upstream burst "$BURST_URL")
$(nginx_server "$NGINX_PORT" sim)
$(nginx_server "$NGINX_SLOW_PORT" slow)
$(nginx_server "$NGINX_PACED_PORT" paced)
$(nginx_server "$NGINX_BURST_PORT" burst)
}
EOF

log "starting nginx"
"$NGINX_BIN" -p "$N/" -c "$N/nginx.conf" -e "$N/error.log" >"$TMP/nginx.log" 2>&1 &
NGINX_PID=$!
STARTED+=("$NGINX_PID")
NGINX_WORKER_PIDS=""
for _ in $(seq 1 100); do
    NGINX_WORKER_PIDS=$(pgrep -P "$NGINX_PID" | paste -sd, - || true)
    [ "$(echo "$NGINX_WORKER_PIDS" | tr ',' '\n' | grep -c .)" -ge "$NGINX_WORKERS" ] && break
    kill -0 "$NGINX_PID" 2>/dev/null || { cat "$TMP/nginx.log" "$N/error.log" >&2 || true; die "nginx exited during start"; }
    sleep 0.1
done
[ -n "$NGINX_WORKER_PIDS" ] || die "nginx started no worker within 10 s"
NGINX_URL="http://127.0.0.1:$NGINX_PORT"
NGINX_SLOW_URL="http://127.0.0.1:$NGINX_SLOW_PORT"
NGINX_PACED_URL="http://127.0.0.1:$NGINX_PACED_PORT"
NGINX_BURST_URL="http://127.0.0.1:$NGINX_BURST_PORT"
for u in "$NGINX_URL" "$NGINX_SLOW_URL" "$NGINX_PACED_URL" "$NGINX_BURST_URL"; do wait_http "$u/health" nginx; done

# --- run --------------------------------------------------------------------------------------
CPU_MODEL=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
{
    echo "# fleetgate hop benchmark, $STAMP"
    echo
    echo "- machine: $(nproc) CPUs, $CPU_MODEL, kernel $(uname -r); load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "- fleetgate $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)'), $(rustc -V)"
    echo "- $("$NGINX_BIN" -v 2>&1), worker_processes $NGINX_WORKERS; gateway workers: ${GATEWAY_WORKERS:-default ($(nproc))}"
    echo "- open-file limit (ulimit -n) of every process: $NOFILE"
    echo "- command: scripts/bench-hop.sh $*"
    echo
} >"$RUN_DIR/summary.md"

COMMON=(--fleetgate "$GW_URL" --gateway-pid "$GW_PID" --nginx-pids "$NGINX_WORKER_PIDS")

log "main pass (sim: $SIM_FLAGS; pids: gateway $GW_PID, nginx workers $NGINX_WORKER_PIDS, sim $SIM_PID)"
cargo bench -q --bench hop -- "${COMMON[@]}" \
    --label "sim $SIM_FLAGS" --direct "$SIM_URL" --nginx "$NGINX_URL" --model qwen32b --sim-pid "$SIM_PID" \
    --mem-fleetgate "$GW_URL" --mem-nginx "$NGINX_SLOW_URL" --mem-model slow \
    --burst-model burst --burst-nginx "$NGINX_BURST_URL" --burst-direct "$BURST_URL" --burst-sim-pid "$BURST_PID" \
    --out "$RUN_DIR/hop.json" "$@" >>"$RUN_DIR/summary.md"

if [ "$PACED" = 1 ]; then
    log "paced pass (tokens one by one)"
    # shellcheck disable=SC2086 # PACED_ARGS is a list of flags
    cargo bench -q --bench hop -- "${COMMON[@]}" \
        --label "$PACED_LABEL" --direct "$PACED_URL" --nginx "$NGINX_PACED_URL" \
        --model paced --sim-pid "$PACED_PID" --phases latency,openloop --no-targets \
        --out "$RUN_DIR/hop-paced.json" $PACED_ARGS >>"$RUN_DIR/summary.md"
fi

if [ "$THROUGHPUT" = 1 ]; then
    log "throughput pass (not streamed, wrk -c $TP_CONNECTIONS)"
    chat_lua "$TMP/post.lua" "$FLEETGATE_BENCH_KEY"
    # ticks PIDS: utime+stime of the comma-separated pids, in clock ticks, summed.
    ticks() {
        local t=0 pid
        for pid in ${1//,/ }; do t=$((t + $(awk '{print $14 + $15}' "/proc/$pid/stat"))); done
        echo "$t"
    }
    declare -A TP_REQ TP_SECS TP_GW TP_NGX TP_SIM TP_ERR
    for name in direct fleetgate nginx; do
        TP_REQ[$name]=0 TP_SECS[$name]=0 TP_GW[$name]=0 TP_NGX[$name]=0 TP_SIM[$name]=0 TP_ERR[$name]=0
    done
    for round in $(seq 1 "$TP_ROUNDS"); do
        for name in direct fleetgate nginx; do
            case $name in
                direct) url=$SIM_URL ;;
                fleetgate) url=$GW_URL ;;
                nginx) url=$NGINX_URL ;;
            esac
            out="$TMP/wrk-$name-$round.txt"
            g0=$(ticks "$GW_PID") n0=$(ticks "$NGINX_WORKER_PIDS") s0=$(ticks "$SIM_PID")
            wrk -t 1 -c "$TP_CONNECTIONS" -d "${TP_SECS_EACH}s" -s "$TMP/post.lua" \
                "$url/v1/chat/completions" >"$out" 2>&1 || die "wrk failed against $name: $(cat "$out")"
            g1=$(ticks "$GW_PID") n1=$(ticks "$NGINX_WORKER_PIDS") s1=$(ticks "$SIM_PID")
            # "  123456 requests in 5.00s, 51.2MB read"; errors: "Non-2xx or 3xx responses: N",
            # "Socket errors: connect N, read N, write N, timeout N".
            req=$(awk '/requests in/ {print $1}' "$out")
            secs=$(awk '/requests in/ {v = $4; sub(/s,$/, "", v); print v}' "$out")
            err=$(awk '/Non-2xx/ {e += $NF} /Socket errors/ {for (i = 4; i <= NF; i += 2) {v = $i; gsub(/,/, "", v); e += v}} END {print e + 0}' "$out")
            TP_REQ[$name]=$((TP_REQ[$name] + req))
            TP_ERR[$name]=$((TP_ERR[$name] + err))
            TP_SECS[$name]=$(awk -v a="${TP_SECS[$name]}" -v b="$secs" 'BEGIN {print a + b}')
            TP_GW[$name]=$((TP_GW[$name] + g1 - g0))
            TP_NGX[$name]=$((TP_NGX[$name] + n1 - n0))
            TP_SIM[$name]=$((TP_SIM[$name] + s1 - s0))
        done
    done
    HZ=$(getconf CLK_TCK)
    {
        echo "### 4. Non-streamed throughput, closed loop (wrk, $TP_CONNECTIONS connections, $TP_SECS_EACH s x $TP_ROUNDS rotations)"
        echo
        echo "| target | requests | errors | req/s | gateway CPU/req | nginx CPU/req | sim CPU/req |"
        echo "|---|---|---|---|---|---|---|"
        for name in direct fleetgate nginx; do
            awk -v n="$name" -v r="${TP_REQ[$name]}" -v e="${TP_ERR[$name]}" -v s="${TP_SECS[$name]}" \
                -v g="${TP_GW[$name]}" -v x="${TP_NGX[$name]}" -v m="${TP_SIM[$name]}" -v hz="$HZ" 'BEGIN {
                    us = 1e6 / hz / (r > 0 ? r : 1)
                    printf "| %s | %d | %d | %.0f | %.1f µs | %.1f µs | %.1f µs |\n", n, r, e, r / (s > 0 ? s : 1), g * us, x * us, m * us
                }'
        done
        echo
        echo "Each request: a chat completion of max_tokens 16, not streamed, to the zero-delay sim."
        echo "CPU per request = the process's utime+stime over its target's slices / requests, in"
        echo "clock ticks of 1/$HZ s. wrk shares the two cores with the proxy and the sim."
        echo
    } >>"$RUN_DIR/summary.md"
fi

if [ "${TRACING:-0}" = 1 ]; then
    # Proof that the spans went out: the sink's exports (a batch per second at most).
    sleep 1.5
    {
        echo "Tracing on (always_on): the OTLP sink received $(grep -c '^export /v1/traces' "$TMP/otlp-sink.log" || true) exports,"
        echo "$(awk '/^export \/v1\/traces/ {b += $3} END {print b + 0}' "$TMP/otlp-sink.log") bytes of protobuf in all."
        echo
    } >>"$RUN_DIR/summary.md"
fi

cp "$RUN_DIR/summary.md" "$ROOT/bench-out/hop-latest.md"
for f in "$RUN_DIR"/hop*.json; do cp "$f" "$ROOT/bench-out/$(basename "$f" .json)-latest.json"; done
cat "$RUN_DIR/summary.md"
log "results in ${RUN_DIR#"$ROOT"/}/ (and bench-out/hop-latest.md, hop-latest.json, hop-paced-latest.json)"
