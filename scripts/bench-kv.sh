#!/usr/bin/env bash
# Reproduces the KV-event routing comparison of docs/benchmarks.md ("Routing on the engines'
# KV events") in one command:
#   scripts/bench-kv.sh
#
# For each prefix-cache size in KV_SIZES it starts, on 127.0.0.1, BACKENDS simulated vLLM
# servers that cut prompts into the model's own tokens (--tokenizer MODEL_DIR, Qwen's BPE and
# Qwen3's chat template), pay prefill only for the uncached part (PREFILL_US µs a token), report
# cached tokens (--enable-prompt-tokens-details) and publish their caches' stores and evictions
# as vLLM does (--kv-events-config, bound on a port of their own). In front of the same sims:
#   - fleetgate, weighted power-of-two-choices (no affinity)             "P2C"
#   - fleetgate, [pools.affinity] by = "longest_prefix"                   "longest_prefix"
#   - fleetgate, [pools.affinity] by = "kv_events", [pools.kv_events]     "kv_events"
#     with the same tokenizer directory
#   - the same with kv_events = false on every backend: no subscription;    "estimated"
#     what each engine holds is estimated from the prompts sent to it,
#     within the cache size its /metrics reports (vllm:cache_config_info)
#   - with REPLICAS > 1, also that many replicas of the kv_events gateway behind Debian's nginx
#     as a round-robin balancer, each subscribing to the engines itself (no Redis, no
#     shared state but the SQLite key store)                               "kv_events × N"
# Then `fleetgate bench`'s multi-turn mode runs agent traffic through each of them, ROUNDS
# times, the order turning every round; each run has a seed of its own, so its texts (system
# prompt included) are new and no run finds an earlier run's prefixes. Each run reports TTFT
# p50 (later turns, and all turns) and p99, the engines' hit rate (the sims' own counters), what
# the gateway believed (fleetgate_prompt_cache_tokens_total: predicted / prompt on the
# backends it chose; for longest_prefix also its routing hit share), the prediction's error
# (the mean |predicted - served| per answer, in points of the prompt), and the gateway's CPU
# time per request.
#
# Results: bench-out/kv-<UTC time>/ (git-ignored): every run's result JSON and text, the
# gateways' counters before and after each run (and every metric of the gateways and the sims,
# *.metrics.before / *.metrics.after), logs/, and summary.md (medians over the rounds), also
# copied to bench-out/kv-latest.md and printed.
#
# Environment (defaults in brackets):
#   FLEETGATE_BIN     the fleetgate binary (this checkout's release build, built first)
#   MODEL_DIR         a model directory with tokenizer.json and a chat template
#                     [$FLEETGATE_VLLM_HOME/tiny-qwen, built by `scripts/real-vllm.sh model
#                     --qwen` when missing]
#   KV_SIZES ["6000 16000 400000"]  prefix-cache capacities per sim, tokens: below one
#                     conversation, about two, ample (summary.md gives a conversation's size)
#   ROUNDS [3]        rounds of every target and cache size
#   BACKENDS [4]      simulated servers
#   PREFILL_US [100]  sim prefill time per uncached prompt token, µs
#   DECODE_MS [5]     sim decode step, ms
#   CONVERSATIONS [16] TURNS [6] SYSTEM_LEN [6000] USER_LEN [200] OUTPUT_LEN [32]
#   THINK_MS [200]    the multi-turn workload (see docs/bench.md)
#   REPLICAS [3]      kv_events replicas behind round robin, measured beside one (1: not run)
#   ONLY [all]        the targets to run, e.g. "p2c kv" (p2c longest kv est kvn)
#   REQUEST_EVENTS [false]  true: the gateways log one line per request (backend, TTFT, e2e),
#                     in logs/<target>-<size>.log, to see where each request went and when
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
RUN_DIR="$ROOT/bench-out/kv-$STAMP"
KV_SIZES=${KV_SIZES:-"6000 16000 400000"}
ROUNDS=${ROUNDS:-3}
BACKENDS=${BACKENDS:-4}
PREFILL_US=${PREFILL_US:-100}
DECODE_MS=${DECODE_MS:-5}
CONVERSATIONS=${CONVERSATIONS:-16}
TURNS=${TURNS:-6}
SYSTEM_LEN=${SYSTEM_LEN:-6000}
USER_LEN=${USER_LEN:-200}
OUTPUT_LEN=${OUTPUT_LEN:-32}
THINK_MS=${THINK_MS:-200}
REPLICAS=${REPLICAS:-3}
BIN=${FLEETGATE_BIN:-"$ROOT/target/release/fleetgate"}
VHOME=${FLEETGATE_VLLM_HOME:-"$HOME/.cache/fleetgate/vllm"}
MODEL_DIR=${MODEL_DIR:-"$VHOME/tiny-qwen"}

SCRIPT_NAME=bench-kv
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"

if [ -z "${FLEETGATE_BIN:-}" ]; then
    log "building (release)"
    cargo build --release -q
fi
[ -x "$BIN" ] || die "no fleetgate binary at $BIN"
if [ ! -f "$MODEL_DIR/tokenizer.json" ]; then
    log "no tokenizer at $MODEL_DIR: building Qwen's (scripts/real-vllm.sh model --qwen)"
    "$ROOT/scripts/real-vllm.sh" model --qwen || die "cannot build the model directory (set MODEL_DIR)"
fi

TMP=$(mktemp -d /tmp/bench-kv.XXXXXX)
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

# Two consecutive free ports (the sim's publisher and its replay endpoint).
two_ports() {
    python3 -c '
import socket
for _ in range(200):
    a = socket.socket(); a.bind(("127.0.0.1", 0)); p = a.getsockname()[1]
    if p >= 65535:
        a.close(); continue
    b = socket.socket()
    try:
        b.bind(("127.0.0.1", p + 1)); print(p); break
    except OSError:
        pass
    finally:
        a.close(); b.close()
'
}


declare -A URL PID ADMIN
# start_fleetgate NAME TAG POOL_EXTRA_TOML: fleetgate in front of this size's sims.
start_fleetgate() {
    local name=$1 tag=$2 extra=$3 admin
    admin=$(free_port)
    cat >"$TMP/$name-$tag.toml" <<EOF
[server]
listen = "127.0.0.1:0"
log_format = "text"
request_log_events = ${REQUEST_EVENTS:-false}
shutdown_grace_seconds = 1
health_interval_ms = 5000

[request_log]
enabled = false
spill_path = "$TMP/$name-$tag.spill"

[database]
sqlite_path = "$TMP/keys.db"

[admin]
listen = "127.0.0.1:$admin"

# No capacity cap: the balancers alone decide.
[[pools]]
model = "qwen32b"
max_in_flight_per_backend = 0
$extra
EOF
    "$BIN" serve --config "$TMP/$name-$tag.toml" >"$TMP/$name-$tag.log" 2>&1 &
    PID[$name]=$!
    STARTED+=($!)
    URL[$name]=$(wait_url "$TMP/$name-$tag.log" $! "$name")
    ADMIN[$name]="http://127.0.0.1:$admin"
}

# start_replicas NAME TAG POOL_EXTRA_TOML: REPLICAS gateways and a round-robin nginx in front;
# PID and ADMIN of NAME list them all.
start_replicas() {
    local name=$1 tag=$2 extra=$3 pids="" admins="" servers="" port i
    for i in $(seq 1 "$REPLICAS"); do
        start_fleetgate "$name-r$i" "$tag" "$extra"
        pids+=" ${PID[$name-r$i]}"
        admins+=" ${ADMIN[$name-r$i]}"
        servers+="        server ${URL[$name-r$i]#http://};"$'\n'
    done
    port=$(free_port)
    mkdir -p "$TMP/nginx-$tag"
    cat >"$TMP/nginx-$tag/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $TMP/nginx-$tag/nginx.pid;
error_log $TMP/nginx-$tag/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $TMP/nginx-$tag/client_body;
    client_max_body_size 16m;
    client_body_buffer_size 1m;
    proxy_temp_path $TMP/nginx-$tag/proxy;
    tcp_nodelay on;
    upstream replicas {
$servers        keepalive 64;
    }
    server {
        listen 127.0.0.1:$port;
        location / {
            proxy_pass http://replicas;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }
    }
}
EOF
    "$NGINX_BIN" -p "$TMP/nginx-$tag/" -c "$TMP/nginx-$tag/nginx.conf" >"$TMP/nginx-$tag.log" 2>&1 &
    STARTED+=($!)
    URL[$name]="http://127.0.0.1:$port"
    PID[$name]=${pids# }
    ADMIN[$name]=${admins# }
    for _ in $(seq 1 100); do
        curl -sf -o /dev/null "${URL[$name]}/health" && return 0
        sleep 0.1
    done
    die "nginx in front of the replicas did not answer within 10 s"
}

# CPU time of every process listed.
cpu_all() {
    local total=0 p
    for p in $1; do total=$((total + $(cpu_ns "$p"))); done
    echo "$total"
}

# The gateway's cache and routing counters, one "name value" line each (summed over replicas
# by the summary).
counters() {
    local a
    for a in ${ADMIN[$1]}; do curl -sf "$a/metrics"; done | awk '
        /^fleetgate_prompt_cache_tokens_total\{/ { match($0, /kind="[a-z]+"/); k = substr($0, RSTART + 6, RLENGTH - 7); print "cache_" k, $NF }
        /^fleetgate_prefix_routing_total\{/ { match($0, /outcome="[a-z]+"/); k = substr($0, RSTART + 9, RLENGTH - 10); print "prefix_" k, $NF }
        /^fleetgate_kv_routing_total\{/ { match($0, /outcome="[a-z]+"/); k = substr($0, RSTART + 9, RLENGTH - 10); print "kv_" k, $NF }'
}

# Every metric of the gateway(s) and of the sims, for a closer look at a run (per backend: the
# upstream TTFT histogram, requests; per sim: prefilled tokens, cache hits).
snapshot() {
    local a u
    for a in ${ADMIN[$1]}; do curl -sf "$a/metrics" | sed "s|^|gateway $a |"; done
    for u in "${SIM_URLS[@]}"; do curl -sf "$u/metrics" | sed "s|^|sim $u |"; done
}

RESULTS="$RUN_DIR/runs.tsv"
printf 'kv\tround\ttarget\tcpu_ns\tfile\tbefore\tafter\n' >"$RESULTS"
TARGETS=(p2c longest kv est)
[ "$REPLICAS" -gt 1 ] && TARGETS+=(kvn) && find_nginx
# ONLY="p2c kv": run only these targets (the others still start).
[ -n "${ONLY:-}" ] && read -r -a TARGETS <<<"$ONLY"
seed=500
for kv_tokens in $KV_SIZES; do
    log "cache of $kv_tokens tokens per sim"
    STARTED=()
    SIM_URLS=()
    KV_PORTS=()
    for i in $(seq 1 "$BACKENDS"); do
        port=$(two_ports)
        [ -n "$port" ] || port=$(two_ports)
        [ -n "$port" ] || die "no two consecutive free ports for sim $i's publisher and replay endpoint"
        events=$(printf '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:%s", "replay_endpoint": "tcp://*:%s", "topic": "kv"}' "$port" $((port + 1)))
        "$BIN" sim --host 127.0.0.1 --port 0 --served-model-name qwen32b \
            --kv-cache-tokens "$kv_tokens" --enable-prompt-tokens-details \
            --tokenizer "$MODEL_DIR" --kv-events-config "$events" \
            --prefill-us-per-token "$PREFILL_US" --decode-step-ms "$DECODE_MS" \
            --decode-ms-per-seq 0.1 --max-num-seqs 64 --seed "$i" >"$TMP/sim$i-$kv_tokens.log" 2>&1 &
        STARTED+=($!)
        SIM_URLS+=("$(wait_url "$TMP/sim$i-$kv_tokens.log" $! "sim $i")")
        KV_PORTS+=("$port")
    done
    CACHE_URLS=$(
        IFS=,
        echo "${SIM_URLS[*]}"
    )
    plain=$(printf '"%s", ' "${SIM_URLS[@]}")
    plain="backends = [${plain%, }]"
    tables=""
    for i in "${!SIM_URLS[@]}"; do
        tables+=$'\n'"[[pools.backends]]"$'\n'"url = \"${SIM_URLS[$i]}\""$'\n'"kv_events_port = ${KV_PORTS[$i]}"
    done
    start_fleetgate p2c "$kv_tokens" "$plain"
    if [ -z "${KEY:-}" ]; then
        KEY=$(create_key "$TMP/p2c-$kv_tokens.toml" kv-bench "$TMP/keys.log")
        export OPENAI_API_KEY=$KEY
    fi
    start_fleetgate longest "$kv_tokens" "$plain"$'\n[pools.affinity]\nby = "longest_prefix"'
    kv_toml="$tables"$'\n[pools.affinity]\nby = "kv_events"\n[pools.kv_events]\ntopic = "kv"\nport = '"${KV_PORTS[0]}"$'\nreplay_port = '"$((KV_PORTS[0] + 1))"$'\ntokenizer = "'"$MODEL_DIR"'"'
    start_fleetgate kv "$kv_tokens" "$kv_toml"
    est_toml=""
    for i in "${!SIM_URLS[@]}"; do
        est_toml+=$'\n'"[[pools.backends]]"$'\n'"url = \"${SIM_URLS[$i]}\""$'\n'"kv_events = false"
    done
    est_toml+=$'\n[pools.affinity]\nby = "kv_events"\n[pools.kv_events]\ntokenizer = "'"$MODEL_DIR"'"'
    start_fleetgate est "$kv_tokens" "$est_toml"
    [ "$REPLICAS" -gt 1 ] && start_replicas kvn "$kv_tokens" "$kv_toml"
    # Every subscriber live before the first run.
    want=$((BACKENDS * (1 + (REPLICAS > 1 ? REPLICAS : 0))))
    for _ in $(seq 1 100); do
        live=$(for a in ${ADMIN[kv]} ${ADMIN[kvn]:-}; do curl -sf "$a/metrics"; done | grep -c '^fleetgate_kv_events_state{.*} 2$' || true)
        [ "$live" -ge "$want" ] && break
        sleep 0.1
    done
    [ "$live" -ge "$want" ] || die "the kv_events gateways' subscribers are not live ($live of $want)"
    for _ in $(seq 1 100); do
        known=$(curl -sf "${ADMIN[est]}/metrics" | grep -c '^fleetgate_kv_events_state{.*rank="estimated"} 3$' || true)
        [ "$known" -ge "$BACKENDS" ] && break
        sleep 0.1
    done
    [ "$known" -ge "$BACKENDS" ] || die "the estimating gateway never read the sims' cache sizes ($known of $BACKENDS)"
    n=${#TARGETS[@]}
    for round in $(seq 1 "$ROUNDS"); do
        for k in $(seq 0 $((n - 1))); do
            target=${TARGETS[$(((k + round - 1) % n))]}
            seed=$((seed + 1))
            out="$RUN_DIR/$kv_tokens-$round-$target"
            log "cache $kv_tokens, round $round, $target"
            counters "$target" >"$out.before"
            snapshot "$target" >"$out.metrics.before"
            before=$(cpu_all "${PID[$target]}")
            "$BIN" bench --base-url "${URL[$target]}" --endpoint-type openai-chat --model qwen32b \
                --multi-turn-conversations "$CONVERSATIONS" --multi-turn-turns "$TURNS" \
                --multi-turn-system-len "$SYSTEM_LEN" --multi-turn-user-len "$USER_LEN" \
                --multi-turn-think-ms "$THINK_MS" --random-output-len "$OUTPUT_LEN" --ignore-eos \
                --cache-metrics-url "$CACHE_URLS" --seed "$seed" \
                --output "$out.json" >"$out.txt" 2>&1 || {
                cat "$out.txt" >&2
                die "bench failed ($target, cache $kv_tokens)"
            }
            after=$(cpu_all "${PID[$target]}")
            counters "$target" >"$out.after"
            snapshot "$target" >"$out.metrics.after"
            printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$kv_tokens" "$round" "$target" "$((after - before))" \
                "$out.json" "$out.before" "$out.after" >>"$RESULTS"
        done
    done
    stop_started
done

# --- the summary ------------------------------------------------------------------------------
python3 - "$RESULTS" "$REPLICAS" >"$RUN_DIR/summary.md" <<'EOF'
import json, statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])][1:]
names = {"p2c": "P2C (no affinity)", "longest": "longest_prefix", "kv": "kv_events",
         "est": "kv_events, estimated (no events)",
         "kvn": f"kv_events, {sys.argv[2]} replicas (round robin)"}
def counters(path):
    out = {}
    for line in open(path):
        k, v = line.split()
        out[k] = out.get(k, 0.0) + float(v)
    return out
by, sizes, conv = {}, [], {}
for kv, rnd, target, ns, path, before, after in rows:
    if kv not in sizes:
        sizes.append(kv)
    r = json.load(open(path))
    mt = r["multi_turn"]
    b, a = counters(before), counters(after)
    d = lambda k: a.get(k, 0.0) - b.get(k, 0.0)
    prompt = d("cache_prompt")
    believed = 100.0 * d("cache_predicted") / prompt if prompt else None
    error = 100.0 * d("cache_error") / prompt if prompt else None
    routed = d("prefix_hit") + d("prefix_miss")
    by.setdefault((kv, target), []).append({
        "later": mt["later_turns"]["median_ttft_ms"], "p50": r["median_ttft_ms"], "p99": r["p99_ttft_ms"],
        "served": (mt["prefix_cache"].get("hit_rate") or 0.0) * 100.0,
        "believed": believed, "error": error,
        "route_hits": 100.0 * d("prefix_hit") / routed if routed else None,
        "cpu_us": int(ns) / 1e3 / max(r["completed"], 1),
        "failed": r.get("failed", 0) or 0, "done": r["completed"],
    })
    conv[kv] = r.get("total_input_tokens", 0) / max(r["completed"], 1)
med = lambda xs: statistics.median(xs) if xs else float("nan")
def cell(runs, k, fmt="{:.0f}"):
    xs = [x[k] for x in runs if x[k] is not None]
    if not xs:
        return "–"
    m = fmt.format(med(xs))
    return f"{m} ({min(xs):.0f}–{max(xs):.0f})" if len(xs) > 1 else m
for kv in sizes:
    print(f"### Prefix cache of {kv} tokens per sim\n")
    print("| policy | later-turn TTFT p50 ms | all-turn TTFT p50 ms | TTFT p99 ms | engines served from cache | gateway predicted | prediction error (points) | longest_prefix routing hits | gateway CPU µs/request | requests (failed) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for t in names:
        runs = by.get((kv, t))
        if not runs:
            continue
        pct = lambda k: (cell(runs, k, "{:.1f}") + " %") if any(x[k] is not None for x in runs) else "–"
        print(f"| {names[t]} | {cell(runs, 'later')} | {cell(runs, 'p50')} | {cell(runs, 'p99')} "
              f"| {pct('served')} | {pct('believed')} | {cell(runs, 'error', '{:.1f}')} | {pct('route_hits')} "
              f"| {cell(runs, 'cpu_us')} | {runs[0]['done']} ({sum(x['failed'] for x in runs)}) |")
    p2c, kvr, lp = by.get((kv, "p2c")), by.get((kv, "kv")), by.get((kv, "longest"))
    if p2c and kvr and lp:
        ratio = lambda a, b: med([x["later"] for x in a]) / med([x["later"] for x in b])
        print(f"\nLater-turn TTFT p50, kv_events against P2C: {ratio(kvr, p2c):.2f}×; against longest_prefix: {ratio(kvr, lp):.2f}×.")
        kvn = by.get((kv, "kvn"))
        if kvn:
            print(f"{sys.argv[2]} replicas against 1: {ratio(kvn, kvr):.2f}×.")
    print()
print(f"Medians over the rounds (range in brackets). \"gateway predicted\": the cached prompt tokens the routing predicted on the backends it chose, in percent of the prompt tokens of answers whose engine reported its cache (0 for P2C, which predicts nothing); \"engines served from cache\": the sims' own vllm:prefix_cache_hits / queries.")
EOF
{
    echo "# KV-event routing: $BACKENDS sims, prefill $PREFILL_US µs/token, decode step $DECODE_MS ms, caches of $KV_SIZES tokens"
    echo
    echo "$CONVERSATIONS conversations × $TURNS turns, system prompt $SYSTEM_LEN words shared by all, $USER_LEN new user words and $OUTPUT_LEN output tokens a turn, think $THINK_MS ms; prompts in Qwen's BPE tokens ($MODEL_DIR)."
    echo "fleetgate $("$BIN" --version 2>/dev/null | head -n1) at $(git rev-parse --short HEAD), $(date -u +%Y-%m-%d), $(nproc) cores."
    echo
    cat "$RUN_DIR/summary.md"
} >"$RUN_DIR/summary.full.md"
mv "$RUN_DIR/summary.full.md" "$RUN_DIR/summary.md"
cp "$RUN_DIR/summary.md" "$ROOT/bench-out/kv-latest.md"
cat "$RUN_DIR/summary.md"
