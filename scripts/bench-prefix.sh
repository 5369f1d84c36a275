#!/usr/bin/env bash
# Reproduces the prefix-routing comparison of docs/benchmarks.md ("Prefix routing")
# in one command:
#   scripts/bench-prefix.sh
#
# Starts, on 127.0.0.1 only, BACKENDS simulated vLLM servers with the prefix cache on (KV blocks
# of 16 tokens, --kv-cache-tokens per server, prefill paid only for the uncached part of a
# prompt at PREFILL_US µs a token), and in front of the same sims:
#   - fleetgate, weighted power-of-two-choices (no affinity)           "fleetgate p2c"
#   - fleetgate, [pools.affinity] by = "prefix" (the first 512 bytes)   "fleetgate prefix"
#   - fleetgate, [pools.affinity] by = "longest_prefix"                 "fleetgate longest_prefix"
#   - vLLM's router (PyPI vllm-router, --policy cache_aware)            "vllm-router cache_aware"
# Then it runs `fleetgate bench`'s multi-turn mode through each of them, ROUNDS times, twice a
# round: an even load (CONVERSATIONS conversations sharing one system prompt) and an uneven one
# (the same plus one hot conversation carrying HOT_SHARE of all requests,
# --multi-turn-hot-share). The targets' order turns every round so that drift falls on all of
# them, and every run has a seed of its own: its texts (system prompt included) are new, so no
# run finds what an earlier run left in the sims' caches. Each run reports TTFT p50/p99 over all
# turns, the fleet's prefix-cache hit rate (the sims' vllm:prefix_cache_hits / queries over the
# run) and the router's CPU time per request (its threads' run time over the run, /proc).
#
# Results: bench-out/prefix-<UTC time>/ (git-ignored): every run's result JSON and text, and
# summary.md (medians over the rounds), also copied to bench-out/prefix-latest.md and printed.
#
# Environment (defaults in brackets):
#   FLEETGATE_BIN    the fleetgate binary (this checkout's release build, built first)
#   ROUNDS [3]       rounds of every target and load
#   BACKENDS [4]     simulated servers
#   PREFILL_US [20]  sim prefill time per uncached prompt token, µs: 20 µs is 20 ms per 1k
#                    tokens, a 30B-class model on one GPU (10k tokens of history: 200 ms)
#   DECODE_MS [5]    sim decode step, ms
#   KV_TOKENS [1000000] prefix-cache capacity of each sim, tokens
#   CONVERSATIONS [16] TURNS [8] SYSTEM_LEN [4096] USER_LEN [2048: a tool result] OUTPUT_LEN [64]
#   THINK_MS [200]   the multi-turn workload (see docs/bench.md)
#   HOT_SHARE [0.334] the uneven load's hot share (16 conversations: 8 lanes, 8 of 23 requests)
#   VLLM_ROUTER [1]  0 leaves vLLM's router out (otherwise pip-installed when missing)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
RUN_DIR="$ROOT/bench-out/prefix-$STAMP"
ROUNDS=${ROUNDS:-3}
BACKENDS=${BACKENDS:-4}
PREFILL_US=${PREFILL_US:-20}
DECODE_MS=${DECODE_MS:-5}
KV_TOKENS=${KV_TOKENS:-1000000}
CONVERSATIONS=${CONVERSATIONS:-16}
TURNS=${TURNS:-8}
SYSTEM_LEN=${SYSTEM_LEN:-4096}
USER_LEN=${USER_LEN:-2048}
OUTPUT_LEN=${OUTPUT_LEN:-64}
THINK_MS=${THINK_MS:-200}
HOT_SHARE=${HOT_SHARE:-0.334}
VLLM_ROUTER=${VLLM_ROUTER:-1}
BIN=${FLEETGATE_BIN:-"$ROOT/target/release/fleetgate"}

SCRIPT_NAME=bench-prefix
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"

if [ -z "${FLEETGATE_BIN:-}" ]; then
    log "building (release)"
    cargo build --release -q
fi
[ -x "$BIN" ] || die "no fleetgate binary at $BIN"
if [ "$VLLM_ROUTER" = 1 ] && ! command -v vllm-router >/dev/null; then
    log "installing vLLM's router from PyPI (pip install vllm-router)"
    python3 -m pip install -q vllm-router || die "cannot install vllm-router (VLLM_ROUTER=0 leaves it out)"
fi

TMP=$(mktemp -d /tmp/bench-prefix.XXXXXX)
mkdir -p "$RUN_DIR"
cleanup() {
    stop_started
    mkdir -p "$RUN_DIR/logs"
    cp "$TMP"/*.log "$TMP"/*.toml "$RUN_DIR/logs/" 2>/dev/null || true
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
export NO_COLOR=1 RUST_LOG=${RUST_LOG:-info}

# --- the sims ---------------------------------------------------------------------------------
SIM_URLS=()
for i in $(seq 1 "$BACKENDS"); do
    "$BIN" sim --host 127.0.0.1 --port 0 --served-model-name qwen32b \
        --kv-cache-tokens "$KV_TOKENS" --enable-prompt-tokens-details \
        --prefill-us-per-token "$PREFILL_US" --decode-step-ms "$DECODE_MS" \
        --decode-ms-per-seq 0.1 --max-num-seqs 64 --seed "$i" >"$TMP/sim$i.log" 2>&1 &
    STARTED+=($!)
    SIM_URLS+=("$(wait_url "$TMP/sim$i.log" $! "sim $i")")
done
CACHE_URLS=$(
    IFS=,
    echo "${SIM_URLS[*]}"
)
BACKENDS_TOML=$(printf '"%s", ' "${SIM_URLS[@]}")
BACKENDS_TOML="[${BACKENDS_TOML%, }]"
log "sims: ${SIM_URLS[*]}"

# --- the routers ------------------------------------------------------------------------------
declare -A URL PID
TARGETS=()

# start_fleetgate NAME AFFINITY_TOML
start_fleetgate() {
    local name=$1 affinity=$2
    cat >"$TMP/$name.toml" <<EOF
[server]
listen = "127.0.0.1:0"
log_format = "text"
request_log_events = false
shutdown_grace_seconds = 1
health_interval_ms = 5000

[request_log]
enabled = false
spill_path = "$TMP/$name.spill"

[database]
sqlite_path = "$TMP/keys.db"

[admin]
listen = ""

# No capacity cap (vLLM's router has none): the balancers alone decide.
[[pools]]
model = "qwen32b"
backends = $BACKENDS_TOML
max_in_flight_per_backend = 0
$affinity
EOF
    "$BIN" serve --config "$TMP/$name.toml" >"$TMP/$name.log" 2>&1 &
    PID[$name]=$!
    STARTED+=($!)
    URL[$name]=$(wait_url "$TMP/$name.log" $! "$name")
    TARGETS+=("$name")
}

start_fleetgate fg-p2c ""
KEY=$(create_key "$TMP/fg-p2c.toml" prefix-bench "$TMP/keys.log")
export OPENAI_API_KEY=$KEY
start_fleetgate fg-prefix $'[pools.affinity]\nby = "prefix"'
start_fleetgate fg-longest $'[pools.affinity]\nby = "longest_prefix"'

if [ "$VLLM_ROUTER" = 1 ]; then
    VR_PORT=$(free_port)
    vllm-router --host 127.0.0.1 --port "$VR_PORT" --worker-urls "${SIM_URLS[@]}" \
        --policy cache_aware --log-level warning >"$TMP/vllm-router.log" 2>&1 &
    PID[vllm-router]=$!
    STARTED+=($!)
    URL[vllm-router]="http://127.0.0.1:$VR_PORT"
    for _ in $(seq 1 300); do
        curl -sf -o /dev/null "${URL[vllm-router]}/v1/models" && break
        kill -0 "${PID[vllm-router]}" 2>/dev/null || {
            cat "$TMP/vllm-router.log" >&2
            die "vllm-router exited during start"
        }
        sleep 0.1
    done
    curl -sf -o /dev/null "${URL[vllm-router]}/v1/models" || die "vllm-router did not answer within 30 s"
    TARGETS+=(vllm-router)
fi


# --- the runs ---------------------------------------------------------------------------------
RESULTS="$RUN_DIR/runs.tsv"
printf 'round\tload\ttarget\tcpu_ns\tfile\n' >"$RESULTS"
seed=100
n=${#TARGETS[@]}
for round in $(seq 1 "$ROUNDS"); do
    for load in even hot; do
        for k in $(seq 0 $((n - 1))); do
            target=${TARGETS[$(((k + round - 1) % n))]}
            seed=$((seed + 1))
            extra=()
            [ "$load" = hot ] && extra=(--multi-turn-hot-share "$HOT_SHARE")
            out="$RUN_DIR/$round-$load-$target"
            log "round $round, $load load, $target"
            before=$(cpu_ns "${PID[$target]}")
            "$BIN" bench --base-url "${URL[$target]}" --endpoint-type openai-chat --model qwen32b \
                --multi-turn-conversations "$CONVERSATIONS" --multi-turn-turns "$TURNS" \
                --multi-turn-system-len "$SYSTEM_LEN" --multi-turn-user-len "$USER_LEN" \
                --multi-turn-think-ms "$THINK_MS" --random-output-len "$OUTPUT_LEN" --ignore-eos \
                --cache-metrics-url "$CACHE_URLS" --seed "$seed" "${extra[@]}" \
                --output "$out.json" >"$out.txt" 2>&1 || {
                cat "$out.txt" >&2
                die "bench failed ($target, $load)"
            }
            after=$(cpu_ns "${PID[$target]}")
            printf '%s\t%s\t%s\t%s\t%s\n' "$round" "$load" "$target" "$((after - before))" "$out.json" >>"$RESULTS"
        done
    done
done

# --- the summary ------------------------------------------------------------------------------
python3 - "$RESULTS" >"$RUN_DIR/summary.md" <<'EOF'
import json, statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])][1:]
names = {"fg-p2c": "fleetgate, P2C", "fg-prefix": 'fleetgate, by = "prefix"',
         "fg-longest": 'fleetgate, by = "longest_prefix"', "vllm-router": "vllm-router, cache_aware"}
by = {}
for rnd, load, target, ns, path in rows:
    r = json.load(open(path))
    mt = r["multi_turn"]
    done = r["completed"]
    hot = mt.get("hot") or {}
    by.setdefault((load, target), []).append({
        "p50": r["median_ttft_ms"], "p99": r["p99_ttft_ms"],
        "hit": (mt["prefix_cache"].get("hit_rate") or 0.0) * 100.0,
        "cpu_us": int(ns) / 1e3 / max(done, 1),
        "failed": r.get("failed", 0) or 0, "done": done,
        "hot_p50": hot.get("median_ttft_ms"), "hot_p99": hot.get("p99_ttft_ms"),
        "last_p50": mt["per_turn"][-1]["median_ttft_ms"],
    })
med = lambda xs: statistics.median(xs) if xs else float("nan")
rng = lambda xs: f"{min(xs):.0f}–{max(xs):.0f}" if len(xs) > 1 else f"{xs[0]:.0f}"
for load, title in (("even", "Even load"), ("hot", "Uneven load: one hot conversation")):
    print(f"### {title}\n")
    hot = load == "hot"
    head = "| router | TTFT p50 ms | TTFT p99 ms | last turn's TTFT p50 ms | cache hit rate | router CPU µs/request | requests (failed) |"
    if hot:
        head += " hot conversation's TTFT p50 / p99 ms |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for target in names:
        runs = by.get((load, target))
        if not runs:
            continue
        line = (f"| {names[target]} | {med([x['p50'] for x in runs]):.1f} ({rng([x['p50'] for x in runs])}) "
                f"| {med([x['p99'] for x in runs]):.1f} ({rng([x['p99'] for x in runs])}) "
                f"| {med([x['last_p50'] for x in runs]):.1f} "
                f"| {med([x['hit'] for x in runs]):.1f} % "
                f"| {med([x['cpu_us'] for x in runs]):.0f} ({rng([x['cpu_us'] for x in runs])}) "
                f"| {runs[0]['done']} ({sum(x['failed'] for x in runs)}) |")
        if hot:
            line += f" {med([x['hot_p50'] for x in runs]):.1f} / {med([x['hot_p99'] for x in runs]):.1f} |"
        print(line)
    print()
print(f"Medians over {len(by.get(('even', 'fg-p2c'), []))} rounds (range in brackets).")
EOF
{
    echo "# Prefix routing: $BACKENDS sims, prefill $PREFILL_US µs/token, decode step $DECODE_MS ms, KV cache $KV_TOKENS tokens each"
    echo
    echo "$CONVERSATIONS conversations × $TURNS turns, system prompt $SYSTEM_LEN tokens shared by all, $USER_LEN new user tokens and $OUTPUT_LEN output tokens a turn, think $THINK_MS ms; uneven load: hot share $HOT_SHARE."
    echo "fleetgate $("$BIN" --version 2>/dev/null | head -n1) at $(git rev-parse --short HEAD), $(date -u +%Y-%m-%d), $(nproc) cores."
    echo
    cat "$RUN_DIR/summary.md"
} >"$RUN_DIR/summary.full.md"
mv "$RUN_DIR/summary.full.md" "$RUN_DIR/summary.md"
cp "$RUN_DIR/summary.md" "$ROOT/bench-out/prefix-latest.md"
cat "$RUN_DIR/summary.md"
