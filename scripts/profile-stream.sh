#!/usr/bin/env bash
# Where the gateway's CPU goes on streamed requests: a perf profile of the release gateway
# under a steady load of streams with real token gaps (docs/benchmarks.md, "Profile").
#
#   scripts/profile-stream.sh            # 100 streams/s, 64 tokens 10 ms apart, 20 s
#
# Starts on 127.0.0.1 a sim (one token per 10 ms step), the gateway as shipped (SQLite key store,
# request log on, per-request log events off) and `fleetgate bench` at RATE streams/s; records
# `perf record --call-graph dwarf` of the gateway for SECS seconds in the middle of the run; writes under
# bench-out/profile-<UTC time>/:
#   perf.data, report.txt  (top symbols, self time; and by caller chains)
#   flame.svg              (when inferno-collapse-perf and inferno-flamegraph are installed:
#                           cargo install inferno)
#   categories.md          (the samples by what they were spent on: scripts/profile-categories.py)
#   cpu.txt                (gateway CPU time per stream over the recorded window, perf's own
#                           cost included; bench-hop.sh gives the clean figure)
#
# Environment: RATE (100), TOKENS (64), STEP_MS (10), SECS (20), FREQ (perf sampling Hz, 999),
# MINWIDTH (flame graph: frames under this percentage left out, 0.5), LOAD (stream; plain: wrk
# with 64 connections of requests not streamed to a zero-delay sim instead, as bench-hop.sh's
# throughput pass), TOOL (perf; strace: count the gateway's system calls per request instead,
# into syscalls.txt).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
RATE=${RATE:-100}
TOKENS=${TOKENS:-64}
STEP_MS=${STEP_MS:-10}
SECS=${SECS:-20}
FREQ=${FREQ:-999}
LOAD=${LOAD:-stream}
TOOL=${TOOL:-perf}
OUT="$ROOT/bench-out/profile-$(date -u +%Y%m%dT%H%M%SZ)"
BIN="$ROOT/target/release/fleetgate"

SCRIPT_NAME=profile-stream
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"

command -v perf >/dev/null || die "perf is missing (Debian: apt-get install linux-perf)"
perf stat -e task-clock true >/dev/null 2>&1 || die "perf cannot count here (perf_event_paranoid?)"

log "building (release)"
cargo build --release -q
mkdir -p "$OUT"
TMP=$(mktemp -d /tmp/profile-stream.XXXXXX)
trap 'stop_started; rm -rf "$TMP"' EXIT

export NO_COLOR=1 RUST_LOG=${RUST_LOG:-info}
if [ "$LOAD" = plain ]; then
    SIM_TIMING=(--zero-delay)
else
    SIM_TIMING=(--decode-step-ms "$STEP_MS" --decode-ms-per-seq 0 --prefill-us-per-token 0)
fi
"$BIN" sim --host 127.0.0.1 --port 0 --served-model-name qwen32b "${SIM_TIMING[@]}" \
    --max-num-seqs 1024 >"$TMP/sim.log" 2>&1 &
STARTED+=($!)
SIM_URL=$(wait_url "$TMP/sim.log" "$!" sim)

cat >"$TMP/fleetgate.toml" <<EOF
[server]
listen = "127.0.0.1:0"
log_format = "text"
request_log_events = false

[database]
sqlite_path = "$TMP/fleetgate.db"

[request_log]
spill_path = "$TMP/request-log.spill"

[admin]
listen = ""

[[pools]]
model = "qwen32b"
backends = ["$SIM_URL"]
max_in_flight_per_backend = 0
EOF
"$BIN" migrate --config "$TMP/fleetgate.toml" >/dev/null
KEY=$("$BIN" keys --config "$TMP/fleetgate.toml" create --env stress --name profile 2>/dev/null |
    grep -oE 'fg-stress-[A-Za-z0-9_-]+' | head -n1)
[ -n "$KEY" ] || die "could not create a key"
"$BIN" serve --config "$TMP/fleetgate.toml" >"$TMP/gateway.log" 2>&1 &
GW_PID=$!
STARTED+=("$GW_PID")
GW_URL=$(wait_url "$TMP/gateway.log" "$GW_PID" fleetgate)

# The load: long enough to cover warm-up, the recorded window and a tail.
if [ "$LOAD" = plain ]; then
    command -v wrk >/dev/null || die "wrk is missing (Debian: apt-get install wrk)"
    chat_lua "$TMP/post.lua" "$KEY"
    WHAT="requests not streamed (wrk -c 64, max_tokens 16, zero-delay sim)"
    log "load: $WHAT for $((SECS + 8)) s"
    wrk -t 1 -c 64 -d "$((SECS + 8))s" -s "$TMP/post.lua" "$GW_URL/v1/chat/completions" \
        >"$OUT/wrk.txt" 2>&1 &
else
    PROMPTS=$((RATE * (SECS + 10)))
    WHAT="$RATE streams/s x $TOKENS tokens, $STEP_MS ms apart"
    log "load: $WHAT, $PROMPTS requests"
    OPENAI_API_KEY=$KEY "$BIN" bench --base-url "$GW_URL" --model qwen32b --request-rate "$RATE" \
        --num-prompts "$PROMPTS" --random-input-len 32 --random-output-len "$TOKENS" --ignore-eos \
        --no-progress --output "$OUT/bench.json" >"$OUT/bench.txt" 2>&1 &
fi
LOAD_PID=$!
sleep 5
ticks() { awk '{print $14 + $15}' "/proc/$GW_PID/stat"; }
T0=$(ticks)
log "recording $SECS s of the gateway (pid $GW_PID, $TOOL)"
# Requests the backend finished (its vLLM counter): the window's own count under strace.
served() { curl -fsS "$SIM_URL/metrics" | awk '/^vllm:request_success_total/ {n += $NF} END {printf "%d", n}'; }
if [ "$TOOL" = strace ]; then
    S0=$(served)
    timeout -s INT "$SECS" strace -c -f -p "$GW_PID" -o "$OUT/strace.txt" 2>"$TMP/strace.log" || true
    S1=$(served)
    [ -s "$OUT/strace.txt" ] || { cat "$TMP/strace.log" >&2; die "strace failed"; }
else
    perf record -F "$FREQ" --call-graph dwarf,16384 -p "$GW_PID" -o "$OUT/perf.data" -- sleep "$SECS" 2>"$TMP/perf.log" ||
        { cat "$TMP/perf.log" >&2; die "perf record failed"; }
fi
T1=$(ticks)
HZ=$(getconf CLK_TCK)
wait "$LOAD_PID" || die "the load failed (see $OUT/)"
if [ "$LOAD" = plain ]; then
    # wrk's rate over its whole run stands for the window's.
    N=$(awk -v secs="$SECS" '/Requests\/sec/ {printf "%d", $2 * secs}' "$OUT/wrk.txt")
    grep -E "requests in|Non-2xx|Socket errors" "$OUT/wrk.txt" | tee "$OUT/cpu.txt"
else
    # Open loop at a steady rate: the window sees RATE x SECS streams start and as many finish.
    N=$((RATE * SECS))
    grep -iE "failed|successful" "$OUT/bench.txt" | head -n 3 | tee "$OUT/cpu.txt"
fi
awk -v t="$((T1 - T0))" -v hz="$HZ" -v n="$N" 'BEGIN {
    printf "gateway CPU over the window: %.3f s for ~%d requests: %.1f us per request (perf running)\n",
        t / hz, n, t / hz * 1e6 / n }' | tee -a "$OUT/cpu.txt"

if [ "$TOOL" = strace ]; then
    # System calls per request over the window (strace slows the gateway: counts, not times).
    N=$((S1 - S0))
    [ "$N" -gt 0 ] || die "no request finished while strace was attached"
    log "$N requests finished in the window"
    awk -v n="$N" '$NF ~ /^[a-z_0-9]+$/ && $4 ~ /^[0-9]+$/ {
        calls = $4; errs = ($5 ~ /^[0-9]+$/) ? $5 : 0
        printf "%-16s %8.2f per request (%.2f failed)\n", $NF, calls / n, errs / n }' \
        "$OUT/strace.txt" | sort -k2 -rn | tee "$OUT/syscalls.txt"
    log "results in $OUT"
    exit 0
fi
perf report -i "$OUT/perf.data" --no-children --sort dso,sym --percent-limit 0.5 --stdio \
    >"$OUT/report.txt" 2>/dev/null
perf report -i "$OUT/perf.data" --children --sort sym --percent-limit 2 --stdio -g none \
    >"$OUT/report-children.txt" 2>/dev/null
if command -v inferno-collapse-perf >/dev/null && command -v inferno-flamegraph >/dev/null; then
    perf script -i "$OUT/perf.data" 2>/dev/null | inferno-collapse-perf >"$OUT/stacks.folded"
    inferno-flamegraph --minwidth "${MINWIDTH:-0.5}" \
        --title "fleetgate: $WHAT (release, request log on)" \
        <"$OUT/stacks.folded" >"$OUT/flame.svg"
    log "flame graph: $OUT/flame.svg"
    python3 "$ROOT/scripts/profile-categories.py" "$OUT/stacks.folded" | tee "$OUT/categories.md"
else
    log "no flame graph: cargo install inferno"
fi
log "results in $OUT"
