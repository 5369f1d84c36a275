#!/usr/bin/env bash
# The comparison the product exists for, with realistic token gaps: `fleetgate bench --compare`
# sends the same prompts on the same arrival schedule, interleaved, to a simulated vLLM backend
# directly and through fleetgate — and, as the floor, directly and through Debian's nginx (same
# seed, so the same prompts and schedule). Prints both verdicts and leaves the result JSON under
# bench-out/compare-<UTC time>/.
#   scripts/bench-compare.sh [extra fleetgate bench flags]
# Environment: PROMPTS (default 300), RATE (default 8 req/s to each target, 16 over both), INPUT (256),
# OUTPUT (64), SIM_FLAGS (default: the sim's realistic defaults: 15 ms decode steps + 0.5 ms per
# running sequence, 20 µs of prefill per prompt token), ENDPOINT_TYPE (default openai-chat;
# openai-embeddings runs the sim as an embedding server, `--runner pooling`, and judges E2EL),
# FLEETGATE_BIN (default: this checkout's release build, built first).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PROMPTS=${PROMPTS:-300}
RATE=${RATE:-8}
INPUT=${INPUT:-256}
OUTPUT=${OUTPUT:-64}
SIM_FLAGS=${SIM_FLAGS:-}
ENDPOINT_TYPE=${ENDPOINT_TYPE:-openai-chat}
BIN=${FLEETGATE_BIN:-$ROOT/target/release/fleetgate}
OUT="$ROOT/bench-out/compare-$(date -u +%Y%m%dT%H%M%SZ)"
TMP=$(mktemp -d)
mkdir -p "$OUT" "$TMP/nginx"
SCRIPT_NAME=bench-compare
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"
trap 'stop_started; rm -rf "$TMP"' EXIT

find_nginx
if [ -z "${FLEETGATE_BIN:-}" ]; then
    log "building (release)"
    cargo build --release -q
fi
KIND=generate
METRICS=ttft,tpot,itl,e2el
if [ "$ENDPOINT_TYPE" = openai-embeddings ]; then
    SIM_FLAGS="--runner pooling $SIM_FLAGS"
    KIND=embed
    METRICS=e2el
fi

export NO_COLOR=1 RUST_LOG=info
# shellcheck disable=SC2086 # SIM_FLAGS is a list of flags
"$BIN" sim --host 127.0.0.1 --port 0 --max-num-seqs 256 $SIM_FLAGS >"$TMP/sim.log" 2>&1 &
STARTED+=($!)
SIM_URL=$(wait_url "$TMP/sim.log" "${STARTED[-1]}" sim)

cat >"$TMP/fleetgate.toml" <<EOF
[server]
listen = "127.0.0.1:0"
request_log_events = false
shutdown_grace_seconds = 1
[request_log]
enabled = false
[database]
sqlite_path = "$TMP/fleetgate.db"
[admin]
listen = ""
[[pools]]
model = "qwen32b"
backends = ["$SIM_URL"]
kind = "$KIND"
max_in_flight_per_backend = 0
EOF
FLEETGATE_BENCH_KEY=$("$BIN" keys --config "$TMP/fleetgate.toml" create --env prod --name compare --json |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')
export FLEETGATE_BENCH_KEY
"$BIN" serve --config "$TMP/fleetgate.toml" >"$TMP/fleetgate.log" 2>&1 &
STARTED+=($!)
GW_URL=$(wait_url "$TMP/fleetgate.log" "${STARTED[-1]}" fleetgate)

NGINX_PORT=$(free_port)
nginx_proxy_conf "$TMP/nginx" "$NGINX_PORT" "$SIM_URL" 4096 256
"$NGINX_BIN" -p "$TMP/nginx" -c "$TMP/nginx/nginx.conf" 2>"$TMP/nginx/stderr.log" &
STARTED+=($!)
for _ in $(seq 1 50); do
    curl -sf -o /dev/null "http://127.0.0.1:$NGINX_PORT/health" && break
    sleep 0.1
done

COMMON=(--model qwen32b --api-key-env FLEETGATE_BENCH_KEY --no-progress --seed 1
    --num-prompts "$PROMPTS" --random-input-len "$INPUT" --random-output-len "$OUTPUT"
    --request-rate "$RATE" --num-warmups 10 --endpoint-type "$ENDPOINT_TYPE"
    --percentile-metrics "$METRICS" --metric-percentiles 50,95,99 "$@")
status=0
for via in gateway:"$GW_URL" nginx:"http://127.0.0.1:$NGINX_PORT"; do
    name=${via%%:*}
    url=${via#*:}
    log "direct vs $name ($PROMPTS prompts each, $RATE req/s to each)"
    "$BIN" bench --compare "direct=$SIM_URL" "$name=$url" "${COMMON[@]}" \
        --label "run=$(basename "$OUT")" --output "$OUT/direct-vs-$name.json" \
        >"$OUT/direct-vs-$name.txt" || status=$?
    sed -n '/ vs direct /,$p' "$OUT/direct-vs-$name.txt"
done
echo "results in $OUT"
exit "$status"
