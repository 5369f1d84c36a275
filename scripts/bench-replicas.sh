#!/usr/bin/env bash
# Many gateways, one fleet: one fleetgate replica against three behind a
# round-robin proxy, on the shipped ConfigMap's settings, in one run:
#   scripts/bench-replicas.sh
#
# The gateway configuration is deploy/kubernetes/configmap.yaml's fleetgate.toml as shipped
# (PostgreSQL, Redis, replicas = 3, max_in_flight_per_backend = 32, [pools.priority],
# by = "longest_prefix", warm-up and slow start, ...), with only what a laptop must change:
# 127.0.0.1 listeners, the sims as backends instead of DNS discovery, a spill file under the
# run's directory, and a Redis key prefix of each fleet's own. The replicas of a fleet sit
# behind Debian's nginx, which spreads requests round robin (as a Service spreads them); the
# single replica sits behind the same nginx so both pay the same hop.
#
# Two loads, each against a fleet of 1 and a fleet of 3 replicas, alternating which goes first:
#   flood  a gray flood of FLOOD_CONCURRENCY streams at once (twice the backend's 32 seats), and
#          a prod trickle of PROD_RATE requests/s beside it, against one sim with vLLM's
#          admission (--max-num-seqs 32, the rest wait, --scheduling-policy priority): the
#          prod trickle's TTFT p50/p99;
#   agent  CONVERSATIONS agent conversations of TURNS turns sharing one system prompt, against
#          BACKENDS prefix-caching sims, for AGENT_SECONDS (a conversation that has sent its
#          turns starts over as a new one): the later turns' TTFT p50 and p99 (turns 2..TURNS),
#          all turns' TTFT p50, the fleet's prefix-cache hit rate and the turns served in the
#          time.
# Plus the gateways' CPU time per request (their threads' run time over the run).
#
# Needs PostgreSQL (FLEETGATE_BENCH_PG, default postgres://postgres@127.0.0.1:5432; a database
# of the run's own is created and dropped) and Redis (FLEETGATE_BENCH_REDIS, default
# redis://127.0.0.1:6379).
#
# Results: bench-out/replicas-<UTC time>/ (git-ignored): each run's result JSON and text, and
# summary.md, also copied to bench-out/replicas-latest.md and printed.
#
# Environment (defaults in brackets):
#   FLEETGATE_BIN      the fleetgate binary (this checkout's release build, built first)
#   BENCH_BIN          the binary whose `bench` and `sim` run the loads (FLEETGATE_BIN): set it
#                      to measure an older gateway with this checkout's load generator
#   ROUNDS [2]         rounds of both fleets and both loads
#   FLOOD_SECONDS [30] length of a flood run (the prod trickle starts 3 s in, ends 2 s early)
#   FLOOD_CONCURRENCY [64]  gray streams open at once
#   PROD_RATE [4]      prod requests per second (Poisson)
#   DECODE_MS [10]     the sims' decode step, ms (independent of the batch size)
#   OUTPUT_LEN [48]    output tokens of a flood or prod request (the flood's drawn from ±50 %, so
#                      its requests do not end in lockstep waves)
#   FLOOD_PREFILL_US [1] the flood sim's prefill time per prompt token, µs (a fast GPU; at 20
#                      a wave of 32 new 256-token prompts is one 164 ms step that everyone,
#                      prod included, waits behind)
#   LOADS ["flood agent"] which loads to run
#   BEFORE [1]         also run the flood against 3 replicas without priorities: the
#                      ConfigMap without [pools.priority], in front of a sim with vLLM's default
#                      first-come-first-served admission ("3, no priority")
#   BACKENDS [4] CONVERSATIONS [16] TURNS [6] SYSTEM_LEN [4096] USER_LEN [512] AGENT_OUTPUT_LEN [64]
#   THINK_MS [200]     the agent load (see scripts/bench-prefix.sh)
#   AGENT_SECONDS [30] length of an agent run
#   PREFILL_US [100]   the agent sims' prefill time per uncached prompt token, µs (100 ms per 1k
#                      tokens, a large model on one GPU): prefill, not this 2-core machine's
#                      CPU, sets a later turn's TTFT, as on a real fleet
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
RUN_DIR="$ROOT/bench-out/replicas-$STAMP"
ROUNDS=${ROUNDS:-2}
FLOOD_SECONDS=${FLOOD_SECONDS:-30}
FLOOD_CONCURRENCY=${FLOOD_CONCURRENCY:-64}
PROD_RATE=${PROD_RATE:-4}
DECODE_MS=${DECODE_MS:-10}
OUTPUT_LEN=${OUTPUT_LEN:-48}
BACKENDS=${BACKENDS:-4}
CONVERSATIONS=${CONVERSATIONS:-16}
TURNS=${TURNS:-6}
SYSTEM_LEN=${SYSTEM_LEN:-4096}
USER_LEN=${USER_LEN:-512}
AGENT_OUTPUT_LEN=${AGENT_OUTPUT_LEN:-64}
THINK_MS=${THINK_MS:-200}
AGENT_SECONDS=${AGENT_SECONDS:-30}
PREFILL_US=${PREFILL_US:-100}
FLOOD_PREFILL_US=${FLOOD_PREFILL_US:-1}
LOADS=${LOADS:-flood agent}
BEFORE=${BEFORE:-1}
PG=${FLEETGATE_BENCH_PG:-postgres://postgres@127.0.0.1:5432}
REDIS=${FLEETGATE_BENCH_REDIS:-redis://127.0.0.1:6379}
BIN=${FLEETGATE_BIN:-"$ROOT/target/release/fleetgate"}
BENCH_BIN=${BENCH_BIN:-$BIN}

SCRIPT_NAME=bench-replicas
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"

if [ -z "${FLEETGATE_BIN:-}" ]; then
    log "building (release)"
    cargo build --release -q
fi
[ -x "$BIN" ] || die "no fleetgate binary at $BIN"
find_nginx
command -v psql >/dev/null || die "psql is needed (PostgreSQL's client)"
psql "$PG/postgres" -qAt -c 'select 1' >/dev/null || die "PostgreSQL does not answer at $PG"
redis-cli -u "$REDIS" ping >/dev/null || die "Redis does not answer at $REDIS"

DB="fg_bench_replicas_$$"
TMP=$(mktemp -d /tmp/bench-replicas.XXXXXX)
mkdir -p "$RUN_DIR"
cleanup() {
    stop_started
    mkdir -p "$RUN_DIR/logs"
    cp "$TMP"/*.log "$TMP"/*.toml "$RUN_DIR/logs/" 2>/dev/null || true
    psql "$PG/postgres" -qAt -c "drop database if exists $DB" >/dev/null 2>&1 || true
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
export NO_COLOR=1 RUST_LOG=${RUST_LOG:-info}

psql "$PG/postgres" -qAt -c "create database $DB" >/dev/null
export FLEETGATE_DATABASE_URL="$PG/$DB"
export FLEETGATE_REDIS_URL="$REDIS"
FLEETGATE_ADMIN_JWT_SECRET=$(head -c 32 /dev/urandom | base64)
export FLEETGATE_ADMIN_JWT_SECRET
export VLLM_API_KEY=sim-key

# --- the sims ---------------------------------------------------------------------------------
# sim NAME ARGS...: starts a sim, sets SIM_URL.
sim() {
    local name=$1
    shift
    "$BENCH_BIN" sim --host 127.0.0.1 --port 0 --served-model-name qwen32b --decode-step-ms "$DECODE_MS" \
        --decode-ms-per-seq 0 "$@" >"$TMP/$name.log" 2>&1 &
    STARTED+=($!)
    SIM_URL=$(wait_url "$TMP/$name.log" $! "$name")
}
sim flood-sim --max-num-seqs 32 --scheduling-policy priority --prefill-us-per-token "$FLOOD_PREFILL_US"
FLOOD_SIM=$SIM_URL
sim flood-sim-fcfs --max-num-seqs 32 --prefill-us-per-token "$FLOOD_PREFILL_US"
FCFS_SIM=$SIM_URL
AGENT_SIMS=()
for i in $(seq 1 "$BACKENDS"); do
    sim "agent-sim$i" --max-num-seqs 64 --kv-cache-tokens 1000000 --enable-prompt-tokens-details \
        --prefill-us-per-token "$PREFILL_US" --seed "$i"
    AGENT_SIMS+=("$SIM_URL")
done
CACHE_URLS=$(
    IFS=,
    echo "${AGENT_SIMS[*]}"
)
log "sims: flood $FLOOD_SIM, agent ${AGENT_SIMS[*]}"

# --- the fleets -------------------------------------------------------------------------------
# config NAME BACKENDS_TOML [no-priority]: the ConfigMap's fleetgate.toml with the laptop's
# changes (and without [pools.priority]).
config() {
    local name=$1 backends=$2 variant=${3:-}
    python3 - "$ROOT/deploy/kubernetes/configmap.yaml" "$backends" "$TMP/$name" "fg-bench-$$-$name:" "$variant" \
        >"$TMP/$name.toml" <<'EOF'
import re, sys, yaml
manifest, backends, base, prefix, variant = sys.argv[1:]
text = yaml.safe_load(open(manifest))["data"]["fleetgate.toml"]
def sub(pattern, repl, count=1):
    global text
    new, n = re.subn(pattern, repl, text, count=count, flags=re.M | re.S)
    if n != count:
        sys.exit(f"the ConfigMap changed: {pattern!r} not found")
    text = new
sub(r'^listen = "0\.0\.0\.0:8080"', 'listen = "127.0.0.1:0"')
sub(r'^listen = "0\.0\.0\.0:8081"', 'listen = "127.0.0.1:0"')
sub(r'^log_format = "json"', 'log_format = "text"')
sub(r'^spill_path = "[^"]*"', f'spill_path = "{base}.spill"')
sub(r'^backends = \[\n.*?\n\]', f'backends = {backends}')
sub(r'^replicas = 3', 'replicas = 3\nkey_prefix = "' + prefix + '"')
if variant == "no-priority":
    sub(r'^\[pools\.priority\]\n', '')
print(text)
EOF
}
# fleet NAME N BACKENDS_TOML [VARIANT]: N replicas of one config behind one nginx (round robin); sets
# FLEET_URL and the replicas' pids in PIDS[NAME].
declare -A PIDS
fleet() {
    local name=$1 n=$2 backends=$3 variant=${4:-} i url servers="" port
    config "$name" "$backends" "$variant"
    PIDS[$name]=""
    for i in $(seq 1 "$n"); do
        "$BIN" serve --config "$TMP/$name.toml" >"$TMP/$name-$i.log" 2>&1 &
        STARTED+=($!)
        PIDS[$name]="${PIDS[$name]} $!"
        url=$(wait_url "$TMP/$name-$i.log" $! "$name replica $i")
        servers="$servers server ${url#http://};"
    done
    port=$(free_port)
    mkdir -p "$TMP/nginx-$name"
    cat >"$TMP/nginx-$name/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $TMP/nginx-$name/nginx.pid;
error_log $TMP/nginx-$name/error.log warn;
events { worker_connections 8192; }
http {
    access_log off;
    client_body_temp_path $TMP/nginx-$name/client_body;
    proxy_temp_path $TMP/nginx-$name/proxy;
    tcp_nodelay on;
    upstream replicas { $servers keepalive 256; }
    server {
        listen 127.0.0.1:$port;
        location / {
            proxy_pass http://replicas;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }
    }
}
EOF
    "$NGINX_BIN" -p "$TMP/nginx-$name/" -c "$TMP/nginx-$name/nginx.conf" >"$TMP/nginx-$name.log" 2>&1 &
    STARTED+=($!)
    for _ in $(seq 1 100); do
        curl -s -o /dev/null "http://127.0.0.1:$port/healthz" && break
        sleep 0.1
    done
    FLEET_URL="http://127.0.0.1:$port"
}

"$BIN" migrate --database-url "$FLEETGATE_DATABASE_URL" >"$TMP/migrate.log" 2>&1 ||
    {
        cat "$TMP/migrate.log" >&2
        die "migrations failed"
    }
declare -A URL
fleet flood-1 1 "[\"$FLOOD_SIM\"]"
URL[flood-1]=$FLEET_URL
fleet flood-3 3 "[\"$FLOOD_SIM\"]"
URL[flood-3]=$FLEET_URL
if [ "$BEFORE" = 1 ]; then
    fleet flood-before 3 "[\"$FCFS_SIM\"]" no-priority
    URL[flood-before]=$FLEET_URL
fi
AGENT_TOML=$(printf '"%s", ' "${AGENT_SIMS[@]}")
AGENT_TOML="[${AGENT_TOML%, }]"
fleet agent-1 1 "$AGENT_TOML"
URL[agent-1]=$FLEET_URL
fleet agent-3 3 "$AGENT_TOML"
URL[agent-3]=$FLEET_URL

key() {
    "$BIN" keys --config "$TMP/flood-1.toml" create --env "$1" --name "replicas-bench-$1" --json 2>>"$TMP/keys.log" |
        grep -oE '"key": *"[^"]+"' | head -n1 | sed -E 's/.*"key": *"([^"]+)"/\1/'
}
PROD_KEY=$(key prod)
GRAY_KEY=$(key gray)
[ -n "$PROD_KEY" ] && [ -n "$GRAY_KEY" ] || {
    cat "$TMP/keys.log" >&2
    die "could not create the API keys"
}
export PROD_KEY GRAY_KEY

# The ConfigMap's warm-up ramps a new backend's share over slow_start_seconds: measure a warm
# fleet, as production runs.
slow=$(grep -oE '^slow_start_seconds = [0-9]+' "$TMP/flood-1.toml" | grep -oE '[0-9]+$' || echo 0)
log "fleets up; waiting $((slow + 2)) s for the ConfigMap's slow start to end"
sleep $((slow + 2))

cpu_ns() {
    local pid s=0
    for pid in "$@"; do
        s=$((s + $(cat /proc/"$pid"/task/*/schedstat 2>/dev/null | awk '{s += $1} END {printf "%d\n", s}')))
    done
    echo "$s"
}

# --- the runs ---------------------------------------------------------------------------------
RESULTS="$RUN_DIR/runs.tsv"
printf 'round\tload\treplicas\tcpu_ns\tfile\n' >"$RESULTS"
seed=100
flood_run() {
    local n=$1 out=$2 url=${URL[flood-$1]} gray
    "$BENCH_BIN" bench --base-url "$url" --endpoint-type openai-chat --model qwen32b --api-key-env GRAY_KEY \
        --max-concurrency "$FLOOD_CONCURRENCY" --duration-seconds "$FLOOD_SECONDS" \
        --random-input-len 256 --random-output-len "$OUTPUT_LEN" --random-range-ratio 0.5 --ignore-eos --num-prompts 512 \
        --seed "$seed" --no-progress --output "$out-gray.json" >"$out-gray.txt" 2>&1 &
    gray=$!
    sleep 3
    "$BENCH_BIN" bench --base-url "$url" --endpoint-type openai-chat --model qwen32b --api-key-env PROD_KEY \
        --request-rate "$PROD_RATE" --duration-seconds $((FLOOD_SECONDS - 5)) --num-prompts 256 \
        --random-input-len 256 --random-output-len "$OUTPUT_LEN" --ignore-eos \
        --metric-percentiles 50,99 --seed $((seed + 1)) --no-progress \
        --output "$out.json" >"$out.txt" 2>&1 || {
        cat "$out.txt" >&2
        die "prod trickle failed ($n replicas)"
    }
    wait "$gray" || {
        cat "$out-gray.txt" >&2
        die "gray flood failed ($n replicas)"
    }
}
agent_run() {
    local n=$1 out=$2
    "$BENCH_BIN" bench --base-url "${URL[agent-$n]}" --endpoint-type openai-chat --model qwen32b --api-key-env PROD_KEY \
        --multi-turn-conversations "$CONVERSATIONS" --multi-turn-turns "$TURNS" \
        --multi-turn-system-len "$SYSTEM_LEN" --multi-turn-user-len "$USER_LEN" \
        --multi-turn-think-ms "$THINK_MS" --random-output-len "$AGENT_OUTPUT_LEN" --ignore-eos \
        --duration-seconds "$AGENT_SECONDS" --metric-percentiles 50,99 \
        --cache-metrics-url "$CACHE_URLS" --seed "$seed" --no-progress \
        --output "$out.json" >"$out.txt" 2>&1 || {
        cat "$out.txt" >&2
        die "agent run failed ($n replicas)"
    }
}
for round in $(seq 1 "$ROUNDS"); do
    order="1 3"
    [ $((round % 2)) = 0 ] && order="3 1"
    for load in $LOADS; do
        targets=$order
        [ "$load" = flood ] && [ "$BEFORE" = 1 ] && targets="$order before"
        for n in $targets; do
            seed=$((seed + 2))
            out="$RUN_DIR/$round-$load-$n"
            log "round $round, $load, $n replica(s)"
            # shellcheck disable=SC2086
            before=$(cpu_ns ${PIDS[$load-$n]})
            "${load}_run" "$n" "$out"
            # shellcheck disable=SC2086
            after=$(cpu_ns ${PIDS[$load-$n]})
            printf '%s\t%s\t%s\t%s\t%s\n' "$round" "$load" "$n" "$((after - before))" "$out.json" >>"$RESULTS"
        done
    done
done

# --- the summary ------------------------------------------------------------------------------
python3 - "$RESULTS" >"$RUN_DIR/summary.md" <<'EOF'
import json, os, statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])][1:]
by = {}
for rnd, load, n, ns, path in rows:
    r = json.load(open(path))
    done = r["completed"]
    x = {"p50": r["median_ttft_ms"], "p99": r["p99_ttft_ms"], "failed": r.get("failed", 0) or 0, "done": done}
    if load == "flood":
        g = json.load(open(path.replace(".json", "-gray.json")))
        x["gray_done"] = g["completed"]
        x["gray_failed"] = g.get("failed", 0) or 0
        x["cpu_us"] = int(ns) / 1e3 / max(done + g["completed"], 1)
    else:
        mt = r["multi_turn"]
        x["later_p50"] = mt["later_turns"]["median_ttft_ms"]
        x["later_p99"] = mt["later_turns"]["p99_ttft_ms"]
        x["hit"] = (mt["prefix_cache"].get("hit_rate") or 0.0) * 100.0
        x["cpu_us"] = int(ns) / 1e3 / max(done, 1)
    by.setdefault((load, n), []).append(x)
med = lambda xs: statistics.median(xs)
rng = lambda xs: f"{min(xs):.0f}–{max(xs):.0f}" if len(xs) > 1 else f"{xs[0]:.0f}"
def cell(runs, k):
    xs = [x[k] for x in runs]
    return f"{med(xs):.0f} ({rng(xs)})"
print("### Prod under a gray flood (one sim: 32 seats, the rest wait, --scheduling-policy priority)\n")
print("| replicas | prod TTFT p50 ms | prod TTFT p99 ms | prod requests (failed) | gray requests (failed) | gateway CPU µs/request |")
print("|---|---|---|---|---|---|")
for n in ("1", "3", "before"):
    runs = by.get(("flood", n), [])
    if runs:
        print(f"| {'3, no priority' if n == 'before' else n} | {cell(runs, 'p50')} | {cell(runs, 'p99')} | {sum(x['done'] for x in runs)} ({sum(x['failed'] for x in runs)}) "
              f"| {sum(x['gray_done'] for x in runs)} ({sum(x['gray_failed'] for x in runs)}) | {cell(runs, 'cpu_us')} |")
print()
print("### Agent conversations (prefix-caching sims, by = \"longest_prefix\")\n")
print("| replicas | later-turn TTFT p50 ms | later-turn TTFT p99 ms | all turns' TTFT p50 ms | cache hit rate | turns served a run (failed in all) | gateway CPU µs/request |")
print("|---|---|---|---|---|---|---|")
for n in ("1", "3"):
    runs = by.get(("agent", n), [])
    if runs:
        print(f"| {n} | {cell(runs, 'later_p50')} | {cell(runs, 'later_p99')} | {cell(runs, 'p50')} "
              f"| {med([x['hit'] for x in runs]):.1f} % | {cell(runs, 'done')} ({sum(x['failed'] for x in runs)}) | {cell(runs, 'cpu_us')} |")
print()
rounds = max(len(by.get((load, "1"), [])) for load in ("flood", "agent"))
print(f"Medians over {rounds} rounds (range in brackets); requests summed over the rounds. CPU: all the fleet's replicas' threads' run time over the run, per request.")
def ratio(load, k):
    a = by.get((load, "1"), [])
    b = by.get((load, "3"), [])
    if a and b:
        return med([x[k] for x in b]), med([x[k] for x in a])
print()
for load, k, what, slack in (("flood", "p50", "prod TTFT p50", 20), ("flood", "p99", "prod TTFT p99", 20),
                             ("agent", "later_p50", "later-turn TTFT p50", 10), ("agent", "later_p99", "later-turn TTFT p99", 20),
                             ("agent", "p50", "all turns' TTFT p50", 20)):
    r = ratio(load, k)
    if r:
        three, one = r
        ok = three <= 1.5 * one + slack
        print(f"- {what}: 3 replicas {three:.0f} ms against 1 replica's {one:.0f} ms ({three / one:.2f}×): "
              f"{'within' if ok else 'NOT within'} 1.5× + {slack} ms")
r = ratio("agent", "done")
if r:
    three, one = r
    print(f"- turns served a run: 3 replicas {three:.0f} against 1 replica's {one:.0f} ({three / one:.2f}×): "
          f"{'at least' if three >= 0.9 * one else 'NOT at least'} 0.9×")
# The gray flood's promise holds run by run: each round's 3 replicas against that round's 1.
a = by.get(("flood", "1"), [])
b = by.get(("flood", "3"), [])
if a and b:
    held = [y["p99"] <= 1.5 * x["p99"] + 20 for x, y in zip(a, b)]
    pairs = ", ".join(f"{y['p99']:.0f}/{x['p99']:.0f}" for x, y in zip(a, b))
    print(f"- prod TTFT p99 under the flood, round by round (3 replicas/1 replica ms: {pairs}): "
          f"within 1.5× + 20 ms in {sum(held)} of {len(held)} rounds")
EOF
{
    echo "# One replica against three (deploy/kubernetes/configmap.yaml's settings)"
    echo
    echo "Flood: $FLOOD_CONCURRENCY gray streams at once for $FLOOD_SECONDS s and prod at $PROD_RATE/s, 256 prompt and $OUTPUT_LEN output tokens (gray ±50 %), decode step $DECODE_MS ms, prefill $FLOOD_PREFILL_US µs/token."
    echo "Agent: $AGENT_SECONDS s a run, $BACKENDS sims, $CONVERSATIONS conversations × $TURNS turns (starting over), system prompt $SYSTEM_LEN tokens, $USER_LEN new tokens and $AGENT_OUTPUT_LEN output tokens a turn, think $THINK_MS ms, prefill $PREFILL_US µs/token."
    echo "Gateway: $BIN ($("$BIN" --version 2>/dev/null | head -n1)); loads: $BENCH_BIN; checkout at $(git rev-parse --short HEAD), $(date -u +%Y-%m-%d), $(nproc) cores; nginx round robin in front of each fleet."
    echo
    cat "$RUN_DIR/summary.md"
} >"$RUN_DIR/summary.full.md"
mv "$RUN_DIR/summary.full.md" "$RUN_DIR/summary.md"
cp "$RUN_DIR/summary.md" "$ROOT/bench-out/replicas-latest.md"
cat "$RUN_DIR/summary.md"
