#!/usr/bin/env bash
# What cutting prompts into the engines' tokens costs on the request path (docs/benchmarks.md,
# "Routing on the engines' KV events: its cost"), in one command:
#   scripts/bench-kv-cost.sh
#
# Starts, on 127.0.0.1, one simulated vLLM server with zero delays that cuts prompts into the
# model's own tokens (--tokenizer MODEL_DIR) and publishes its cache's KV events, and in front
# of it:
#   - Debian's nginx, a plain streaming proxy (the floor)                      "nginx"
#   - fleetgate, no affinity                                                     "p2c"
#   - fleetgate, by = "longest_prefix"                                           "longest"
#   - fleetgate, by = "kv_events" with the same tokenizer                        "kv"
# Then one client sends agent turns with a history of about 1k, 8k and 32k tokens: each
# conversation's next turn is its history plus a short new question, as an agent sends it, so
# a gateway that remembers what it tokenized for the history pays only for the new part. Each
# request goes to every target in turn (the order turning every request), so noise falls on
# all alike; each is a streamed chat with max_tokens 1. Reported per target and size: client
# TTFT p50 / p99 against the sim called directly (the added latency), and the proxy's CPU time
# per request (its threads' run time over the run, /proc/PID/task/*/schedstat).
#
# Results: bench-out/kv-cost-<UTC time>/summary.md, also bench-out/kv-cost-latest.md.
#
# Environment (defaults in brackets):
#   FLEETGATE_BIN   the fleetgate binary (this checkout's release build, built first)
#   MODEL_DIR       model directory with tokenizer.json and a chat template
#                   [$FLEETGATE_VLLM_HOME/tiny-qwen, from `scripts/real-vllm.sh model --qwen`]
#   SIZES ["1000 8000 32000"]  history sizes in tokens (approximate: words of the bench's text)
#   CONVERSATIONS [8]  conversations per size; TURNS [6] turns each (the first is not counted)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
RUN_DIR="$ROOT/bench-out/kv-cost-$STAMP"
SIZES=${SIZES:-"1000 8000 32000"}
CONVERSATIONS=${CONVERSATIONS:-8}
TURNS=${TURNS:-6}
BIN=${FLEETGATE_BIN:-"$ROOT/target/release/fleetgate"}
VHOME=${FLEETGATE_VLLM_HOME:-"$HOME/.cache/fleetgate/vllm"}
MODEL_DIR=${MODEL_DIR:-"$VHOME/tiny-qwen"}

SCRIPT_NAME=bench-kv-cost
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
find_nginx

TMP=$(mktemp -d /tmp/bench-kv-cost.XXXXXX)
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

KV_PORT=$(free_port)
"$BIN" sim --host 127.0.0.1 --port 0 --served-model-name qwen32b --zero-delay \
    --kv-cache-tokens 4000000 --enable-prompt-tokens-details --tokenizer "$MODEL_DIR" \
    --kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$KV_PORT\"}" \
    --max-model-len 131072 --max-num-seqs 256 >"$TMP/sim.log" 2>&1 &
STARTED+=($!)
SIM_URL=$(wait_url "$TMP/sim.log" $! sim)

declare -A URL PID
start_fleetgate() { # name pool-extra
    local name=$1 extra=$2
    cat >"$TMP/$name.toml" <<EOF
[server]
listen = "127.0.0.1:0"
log_format = "text"
request_log_events = false
shutdown_grace_seconds = 1

[request_log]
enabled = false
spill_path = "$TMP/$name.spill"

[database]
sqlite_path = "$TMP/keys.db"

[admin]
listen = ""

[[pools]]
model = "qwen32b"
max_in_flight_per_backend = 0
$extra
EOF
    "$BIN" serve --config "$TMP/$name.toml" >"$TMP/$name.log" 2>&1 &
    PID[$name]=$!
    STARTED+=($!)
    URL[$name]=$(wait_url "$TMP/$name.log" $! "$name")
}
start_fleetgate p2c "backends = [\"$SIM_URL\"]"
KEY=$(create_key "$TMP/p2c.toml" kv-cost "$TMP/keys.log")
start_fleetgate longest "backends = [\"$SIM_URL\"]"$'\n[pools.affinity]\nby = "longest_prefix"'
start_fleetgate kv "backends = [\"$SIM_URL\"]"$'\n[pools.affinity]\nby = "kv_events"\n[pools.kv_events]\nport = '"$KV_PORT"$'\ntokenizer = "'"$MODEL_DIR"'"'

NGINX_PORT=$(free_port)
N="$TMP/nginx"
nginx_proxy_conf "$N" "$NGINX_PORT" "$SIM_URL" 1024 16
"$NGINX_BIN" -p "$N/" -c "$N/nginx.conf" -e "$N/error.log" >"$TMP/nginx.log" 2>&1 &
NGINX_PID=$!
STARTED+=("$NGINX_PID")
sleep 0.5
NGINX_WORKER=$(pgrep -P "$NGINX_PID" | head -n1)
[ -n "$NGINX_WORKER" ] || die "nginx started no worker"
URL[nginx]="http://127.0.0.1:$NGINX_PORT"
PID[nginx]=$NGINX_WORKER
URL[direct]=$SIM_URL
PID[direct]=0
for _ in $(seq 1 100); do
    curl -sf -o /dev/null "${URL[nginx]}/health" && break
    sleep 0.1
done
curl -sf -o /dev/null "${URL[nginx]}/health" || die "nginx did not answer within 10 s"

TARGETS="direct nginx p2c longest kv"
ARGS=()
for t in $TARGETS; do ARGS+=("$t=${URL[$t]}=${PID[$t]}"); done
python3 - "$RUN_DIR" "$KEY" "$CONVERSATIONS" "$TURNS" "$SIZES" "${ARGS[@]}" >"$RUN_DIR/summary.body.md" <<'EOF'
import http.client, json, random, statistics, sys, time, urllib.parse

run_dir, key, conversations, turns, sizes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), [int(s) for s in sys.argv[5].split()]
targets = []
for a in sys.argv[6:]:
    name, url, pid = a.split("=", 2)
    u = urllib.parse.urlparse(url)
    targets.append((name, u.hostname, u.port, int(pid)))

def cpu_ns(pid):
    if pid <= 0:
        return 0
    import glob
    total = 0
    for f in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            total += int(open(f).read().split()[0])
        except OSError:
            pass
    return total

conns = {}
def ttft(name, host, port, body):
    c = conns.get(name)
    if c is None:
        c = conns[name] = http.client.HTTPConnection(host, port, timeout=60)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body=body, headers={
        "content-type": "application/json", "authorization": f"Bearer {key}"})
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit(f"{name}: {r.status} {r.read()[:300]!r}")
    first = None
    usage = None
    while True:
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data: ") and first is None and b'"content"' in line:
            first = time.perf_counter() - t0
        if line.startswith(b"data: {") and b'"usage"' in line:
            u = json.loads(line[6:]).get("usage")
            if u:
                usage = u
        if line.strip() == b"data: [DONE]":
            break
    r.read()
    return first if first is not None else time.perf_counter() - t0, usage

rng = random.Random(7)
words = [f"{w}{i}" for i in range(400) for w in ("alpha", "beta", "gamma", "delta", "omega")]
def text(n):
    return " ".join(rng.choice(words) for _ in range(n))

results = {}
tokens_seen = {}
for size in sizes:
    ttfts = {t[0]: [] for t in targets}
    cpu = {t[0]: 0 for t in targets}
    count = 0
    for c in range(conversations):
        # Each target gets a copy of the conversation with its own system prompt, so no target
        # finds another's history in the sim's cache or the gateway's memory.
        base = text(size // 4)
        histories = {t[0]: [{"role": "system", "content": f"{t[0]} {c} " + base}] for t in targets}
        for turn in range(turns):
            question = text(40)
            order = targets[(turn + c) % len(targets):] + targets[:(turn + c) % len(targets)]
            for name, host, port, pid in order:
                h = histories[name]
                h.append({"role": "user", "content": question})
                body = json.dumps({"model": "qwen32b", "messages": h, "max_tokens": 1, "stream": True,
                                   "stream_options": {"include_usage": True}}).encode()
                before = cpu_ns(pid)
                t, usage = ttft(name, host, port, body)
                after = cpu_ns(pid)
                h.append({"role": "assistant", "content": "ok"})
                if turn > 0:
                    ttfts[name].append(t * 1000.0)
                    cpu[name] += after - before
                    if usage:
                        tokens_seen.setdefault(size, []).append(usage["prompt_tokens"])
            if turn > 0:
                count += 1
    results[size] = (ttfts, cpu, count)

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))]
for size in sizes:
    ttfts, cpu, count = results[size]
    toks = tokens_seen.get(size) or [0]
    print(f"### History of about {size} words: prompts of {min(toks)}–{max(toks)} tokens, {count} later turns per target\n")
    print("| target | TTFT p50 ms | TTFT p99 ms | added to direct p50 ms | CPU µs/request |")
    print("|---|---|---|---|---|")
    d50 = statistics.median(ttfts["direct"])
    for name, *_ in targets:
        xs = ttfts[name]
        p50 = statistics.median(xs)
        added = "–" if name == "direct" else f"{p50 - d50:+.2f}"
        cpu_us = "–" if name == "direct" else f"{cpu[name] / 1e3 / max(count, 1):.0f}"
        print(f"| {name} | {p50:.2f} | {pct(xs, 99):.2f} | {added} | {cpu_us} |")
    print()
EOF
{
    echo "# Cutting prompts into the engines' tokens: the cost on the request path"
    echo
    echo "One zero-delay sim with --tokenizer $MODEL_DIR; later turns of $CONVERSATIONS conversations × $TURNS turns per size, sent to every target in turn; streamed chat, max_tokens 1."
    echo "fleetgate $("$BIN" --version 2>/dev/null | head -n1) at $(git rev-parse --short HEAD), $(date -u +%Y-%m-%d), $(nproc) cores; nginx $("$NGINX_BIN" -v 2>&1 | sed 's/.*nginx\///')."
    echo
    cat "$RUN_DIR/summary.body.md"
} >"$RUN_DIR/summary.md"
rm -f "$RUN_DIR/summary.body.md"
cp "$RUN_DIR/summary.md" "$ROOT/bench-out/kv-cost-latest.md"
cat "$RUN_DIR/summary.md"
