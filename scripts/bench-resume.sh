#!/usr/bin/env bash
# The chaos case of issue 60 in one command: a backend killed in the middle of its answers, and
# what the clients of each proxy see.
#   scripts/bench-resume.sh
#
# Each round, for each target in turn (the order turning every round), on 127.0.0.1: three
# fresh `fleetgate sim`s with the same seed (the same model on three servers; a token every
# DECODE_MS), then STREAMS streamed chat answers of OUTPUT_LEN tokens opened together
# (`fleetgate bench`, --ignore-eos), and KILL_AFTER_MS later the sim running the most of them is
# killed with SIGKILL. Targets:
#   - "direct": the client spreads the streams over the sims itself (three bench processes,
#     a third of the streams each)
#   - "nginx": Debian's nginx, round robin over the three (the floor of a plain proxy)
#   - "fleetgate": fleetgate's pool over the three (power of two choices)
# Per target it reports the streams broken (an error, or fewer than OUTPUT_LEN tokens), the
# streams whole, the longest pause between two tokens of each whole stream (p50/p99: a stream
# resumed elsewhere pauses at the seam), and the gateway's CPU time per request.
#
# Results: bench-out/resume-<UTC time>/ (git-ignored): every run's result JSON, the logs, and
# summary.md (also copied to bench-out/resume-latest.md and printed).
#
# Environment (defaults in brackets):
#   FLEETGATE_BIN     the fleetgate binary (this checkout's release build, built first)
#   ROUNDS [3]  STREAMS [60]  OUTPUT_LEN [150]  DECODE_MS [20]  KILL_AFTER_MS [1200]
#   ONLY [all]        the targets to run, e.g. "fleetgate nginx" (direct nginx fleetgate)
#   STALL [false]     true: the busiest sim is stopped (SIGSTOP) instead of killed, its
#                     connections open and silent: a stall, not a death
#   FAULT [kill]      kill, stop (as STALL=true), or none: no sim fails, for the CPU a stream
#                     that never fails costs (run it with two FLEETGATE_BINs, before and after)
#   STALL_MS [2000]   the longest silence between two chunks each proxy waits for (fleetgate's
#                     [pools.timeouts] idle_ms, nginx's proxy_read_timeout)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
RUN_DIR="$ROOT/bench-out/resume-$STAMP"
ROUNDS=${ROUNDS:-3}
STREAMS=${STREAMS:-60}
OUTPUT_LEN=${OUTPUT_LEN:-150}
DECODE_MS=${DECODE_MS:-20}
KILL_AFTER_MS=${KILL_AFTER_MS:-1200}
ONLY=${ONLY:-"direct nginx fleetgate"}
STALL=${STALL:-false}
FAULT=${FAULT:-$([ "$STALL" = true ] && echo stop || echo kill)}
case $FAULT in kill | stop | none) ;; *) echo "FAULT must be kill, stop or none" >&2; exit 2 ;; esac
[ "$FAULT" = stop ] && STALL=true
STALL_MS=${STALL_MS:-2000}
BIN=${FLEETGATE_BIN:-"$ROOT/target/release/fleetgate"}
# The client gives up on a stream after twice its length plus the stall limit.
TIMEOUT_S=$(((2 * OUTPUT_LEN * DECODE_MS + STALL_MS) / 1000 + 5))

SCRIPT_NAME=bench-resume
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"

if [ -z "${FLEETGATE_BIN:-}" ]; then
    log "building (release)"
    cargo build --release -q
fi
[ -x "$BIN" ] || die "no fleetgate binary at $BIN"
find_nginx

TMP=$(mktemp -d /tmp/bench-resume.XXXXXX)
mkdir -p "$RUN_DIR/logs"
cleanup() {
    stop_started
    cp "$TMP"/*.log "$TMP"/*.toml "$RUN_DIR/logs/" 2>/dev/null || true
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
export NO_COLOR=1 RUST_LOG=${RUST_LOG:-info}

# A key for the gateway, made once in the key store every gateway run shares.
cat >"$TMP/key.toml" <<EOF
[database]
sqlite_path = "$TMP/keys.db"

[[pools]]
model = "qwen32b"
backends = ["http://127.0.0.1:9"]
EOF
KEY=$(create_key "$TMP/key.toml" resume-bench "$TMP/keys.log")

# start_sims TAG: three sims, their URLs in SIM_URLS, their pids in SIM_PIDS.
start_sims() {
    local tag=$1 i
    SIM_URLS=()
    SIM_PIDS=()
    for i in 1 2 3; do
        "$BIN" sim --host 127.0.0.1 --port 0 --served-model-name qwen32b \
            --prefill-us-per-token 0 --decode-step-ms "$DECODE_MS" --decode-ms-per-seq 0 \
            --max-num-seqs 256 >"$TMP/sim$i-$tag.log" 2>&1 &
        STARTED+=($!)
        SIM_PIDS+=($!)
        SIM_URLS+=("$(wait_url "$TMP/sim$i-$tag.log" $! "sim $i")")
    done
}

# cpu_tree PID: CPU time (ns) of PID and its children (nginx's worker is its master's child).
cpu_tree() {
    local total child
    total=$(cpu_ns "$1")
    for child in $(pgrep -P "$1" || true); do
        total=$((total + $(cpu_ns "$child")))
    done
    echo "$total"
}

# running URL: the sim's running requests (vllm:num_requests_running).
running() {
    curl -sf "$1/metrics" | awk '/^vllm:num_requests_running/ {s += $2} END {printf "%d\n", s}'
}

# stop_sims: every sim of the run, whatever state it is in.
stop_sims() {
    local pid
    for pid in "${SIM_PIDS[@]}"; do
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
}

# bench URL N OUT [KEY]: N streams opened together against URL, the result in OUT.
bench() {
    local url=$1 n=$2 out=$3 key=${4:-none}
    OPENAI_API_KEY=$key "$BIN" bench --base-url "$url" --model qwen32b \
        --num-prompts "$n" --max-concurrency "$n" --random-input-len 32 \
        --random-output-len "$OUTPUT_LEN" --ignore-eos --request-timeout-seconds "$TIMEOUT_S" \
        --no-progress --save-result --result-filename "$(basename "$out")" \
        --result-dir "$(dirname "$out")" >"$out.txt" 2>&1
}

# run TARGET ROUND: one chaos run; its results in $RUN_DIR/TARGET-ROUND*.json, one TSV row.
run() {
    local target=$1 round=$2 tag="$1-$2" gw="" gw_pid="" port cpu0=0 cpu1=0 pids=() i
    start_sims "$tag"
    case $target in
    fleetgate)
        cat >"$TMP/$tag.toml" <<EOF
[server]
listen = "127.0.0.1:0"
log_format = "text"
request_log_events = false
health_interval_ms = 500

[request_log]
enabled = false
spill_path = "$TMP/$tag.spill"

[database]
sqlite_path = "$TMP/keys.db"

[admin]
listen = ""

[[pools]]
model = "qwen32b"
max_in_flight_per_backend = 0
backends = ["${SIM_URLS[0]}", "${SIM_URLS[1]}", "${SIM_URLS[2]}"]

[pools.timeouts]
idle_ms = $STALL_MS
EOF
        "$BIN" serve --config "$TMP/$tag.toml" >"$TMP/$tag.log" 2>&1 &
        gw_pid=$!
        STARTED+=($!)
        gw=$(wait_url "$TMP/$tag.log" "$gw_pid" fleetgate)
        ;;
    nginx)
        port=$(free_port)
        NGINX_READ_TIMEOUT=${STALL_MS}ms nginx_proxy_conf "$TMP/nginx-$tag" "$port" "${SIM_URLS[*]}" 4096
        "$NGINX_BIN" -p "$TMP/nginx-$tag/" -c "$TMP/nginx-$tag/nginx.conf" >"$TMP/nginx-$tag.log" 2>&1 &
        gw_pid=$!
        STARTED+=($!)
        gw="http://127.0.0.1:$port"
        for _ in $(seq 1 50); do curl -sf -o /dev/null "$gw/health" && break; sleep 0.1; done
        ;;
    esac
    [ -n "$gw_pid" ] && cpu0=$(cpu_tree "$gw_pid")
    if [ "$target" = direct ]; then
        local third=$((STREAMS / 3))
        for i in 0 1 2; do
            bench "${SIM_URLS[$i]}" "$third" "$RUN_DIR/$tag-$i.json" &
            pids+=($!)
        done
    else
        bench "$gw" "$STREAMS" "$RUN_DIR/$tag.json" "$KEY" &
        pids+=($!)
    fi
    sleep "$(awk -v ms="$KILL_AFTER_MS" 'BEGIN {printf "%.3f", ms / 1000}')"
    # The busiest sim dies (or stalls).
    local busiest=0 most=-1 n
    for i in 0 1 2; do
        [ "$FAULT" = none ] && break
        n=$(running "${SIM_URLS[$i]}" || echo 0)
        if [ "$n" -gt "$most" ]; then
            most=$n
            busiest=$i
        fi
    done
    case $FAULT in
    stop) kill -STOP "${SIM_PIDS[$busiest]}" ;;
    kill) kill -KILL "${SIM_PIDS[$busiest]}" ;;
    none) most=0 ;;
    esac
    log "$tag: sim $((busiest + 1)) $FAULT with $most streams running"
    for i in "${pids[@]}"; do wait "$i" || true; done
    [ -n "$gw_pid" ] && cpu1=$(cpu_tree "$gw_pid")
    [ "$STALL" = true ] && kill -CONT "${SIM_PIDS[$busiest]}" 2>/dev/null || true
    stop_sims
    if [ -n "$gw_pid" ]; then
        kill -TERM "$gw_pid" 2>/dev/null || true
        wait "$gw_pid" 2>/dev/null || true
    fi
    printf '%s\t%s\t%s\t%s\n' "$target" "$round" "$most" "$(((cpu1 - cpu0) / STREAMS))" >>"$RUN_DIR/runs.tsv"
}

printf 'target\tround\tkilled_running\tcpu_ns_per_request\n' >"$RUN_DIR/runs.tsv"
read -r -a targets <<<"$ONLY"
for round in $(seq 1 "$ROUNDS"); do
    n=${#targets[@]}
    for k in $(seq 0 $((n - 1))); do
        target=${targets[$(((k + round - 1) % n))]}
        log "round $round, $target"
        run "$target" "$round"
    done
done

python3 - "$RUN_DIR" "$OUTPUT_LEN" "$STREAMS" "$DECODE_MS" "$KILL_AFTER_MS" "$FAULT" >"$RUN_DIR/summary.md" <<'PY'
import csv, glob, json, os, statistics, sys

run_dir, want, streams, decode_ms, kill_ms, fault = sys.argv[1:7]
want = int(want)
rows = list(csv.DictReader(open(os.path.join(run_dir, "runs.tsv")), delimiter="\t"))


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


by_target = {}
for row in rows:
    t, r = row["target"], row["round"]
    files = glob.glob(os.path.join(run_dir, f"{t}-{r}.json")) + glob.glob(
        os.path.join(run_dir, f"{t}-{r}-*.json")
    )
    broken = whole = 0
    gaps = []
    for f in files:
        d = json.load(open(f))
        for err, n, itl in zip(d["errors"], d["output_lens"], d["itls"]):
            if err or n < want:
                broken += 1
            else:
                whole += 1
                gaps.append(max(itl) * 1000 if itl else 0.0)
    by_target.setdefault(t, []).append(
        dict(
            killed=int(row["killed_running"]),
            broken=broken,
            whole=whole,
            gap50=pct(gaps, 50),
            gap99=pct(gaps, 99),
            cpu=int(row["cpu_ns_per_request"]) / 1000,
        )
    )

if fault == "none":
    print(f"# No backend fails: {streams} streams of {want} tokens, a token every {decode_ms} ms, over 3 sims\n")
else:
    what = "stopped (SIGSTOP)" if fault == "stop" else "killed (SIGKILL)"
    print(f"# A backend {what} mid-answer: {streams} streams of {want} tokens, a token every {decode_ms} ms, the busiest of 3 sims {what.split()[0]} {kill_ms} ms in\n")
print("| target | rounds | streams on the dead sim | broken | whole | longest pause in a whole stream, p50 / p99 ms | gateway CPU µs/request |")
print("|---|---|---|---|---|---|---|")
for t in ["direct", "nginx", "fleetgate"]:
    runs = by_target.get(t)
    if not runs:
        continue
    med = lambda k: statistics.median(r[k] for r in runs)
    cpu = "–" if t == "direct" else f"{med('cpu'):.0f}"
    print(
        f"| {t} | {len(runs)} | {med('killed'):.0f} | {med('broken'):.0f} ({min(r['broken'] for r in runs)}–{max(r['broken'] for r in runs)}) "
        f"| {med('whole'):.0f} | {med('gap50'):.0f} / {med('gap99'):.0f} | {cpu} |"
    )
print("\nMedians over the rounds (range of broken streams in brackets). A stream is broken when it")
print("ended with an error or with fewer tokens than asked; the pause is the longest gap between two")
print("tokens of a whole stream.")
PY
cp "$RUN_DIR/summary.md" "$ROOT/bench-out/resume-latest.md"
cat "$RUN_DIR/summary.md"
