#!/usr/bin/env bash
# What the shared limits cost a request: the gateway's own time (`Server-Timing: gw`) per
# environment, with `limits.shared = "redis"` against `"local"`, in one run:
#   scripts/bench-shared-admission.sh
#
# Two gateways (release build) in front of one zero-delay sim, each with the shipped
# config/fleetgate.toml's limits: stress has aggregate caps (`aggregate_requests_per_second`,
# `aggregate_max_concurrent`), gray and prod none. One gateway shares its limits through Redis,
# the other keeps them in process. Keys: stress, gray, prod, and a prod key with a per-key
# rate (`--rpm`), which, like stress, is checked in Redis when shared.
#
# The client sends non-streamed chat requests one at a time on one keep-alive connection per
# (gateway, key), the combinations interleaved request by request, so machine noise falls on
# all of them alike; it reads `Server-Timing: gw` (what the gateway added before the answer's
# head, measured inside it) and its own stopwatch. Beside them: a Redis PING round trip on one
# connection from the same client, the floor one Redis round trip sets.
#
# Results: bench-out/shared-admission-<UTC time>/summary.md (git-ignored), also printed.
#
# Environment (defaults in brackets):
#   FLEETGATE_BIN   the fleetgate binary (this checkout's release build, built first)
#   REQUESTS [2000] requests per (gateway, key)
#   FLEETGATE_BENCH_REDIS [redis://127.0.0.1:6379]
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
RUN_DIR="$ROOT/bench-out/shared-admission-$STAMP"
REQUESTS=${REQUESTS:-2000}
REDIS=${FLEETGATE_BENCH_REDIS:-redis://127.0.0.1:6379}
BIN=${FLEETGATE_BIN:-"$ROOT/target/release/fleetgate"}

SCRIPT_NAME=bench-shared-admission
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"

if [ -z "${FLEETGATE_BIN:-}" ]; then
    log "building (release)"
    cargo build --release -q
fi
[ -x "$BIN" ] || die "no fleetgate binary at $BIN"
redis-cli -u "$REDIS" ping >/dev/null || die "Redis does not answer at $REDIS"

TMP=$(mktemp -d /tmp/bench-shared-admission.XXXXXX)
mkdir -p "$RUN_DIR"
trap 'stop_started; rm -rf "$TMP"' EXIT
trap 'exit 130' INT TERM
export NO_COLOR=1 RUST_LOG=${RUST_LOG:-warn}

RUST_LOG=info "$BIN" sim --host 127.0.0.1 --port 0 --served-model-name qwen32b --zero-delay >"$TMP/sim.log" 2>&1 &
STARTED+=($!)
SIM_URL=$(wait_url "$TMP/sim.log" $! sim)

# gateway NAME SHARED: writes its config, issues its keys (KEYS_<NAME>), starts it (URL_<NAME>,
# PID_<NAME>).
gateway() {
    local name=$1 shared=$2 port
    port=$(free_port)
    cat >"$TMP/$name.toml" <<EOF
[server]
listen = "127.0.0.1:$port"
request_log_events = false

[database]
sqlite_path = "$name.db"

[admin]
listen = ""

[request_log]
spill_path = "$name.spill"

[limits]
shared = "$shared"

[limits.redis]
url = "$REDIS"
key_prefix = "fg-bench-admission-$$-$name"

[limits.stress]
aggregate_requests_per_second = 200000
aggregate_max_concurrent = 48

[[pools]]
model = "qwen32b"
backends = ["$SIM_URL"]
EOF
    local keys=()
    for env in stress gray prod; do
        keys+=("$env=$("$BIN" keys create --config "$TMP/$name.toml" --env "$env" --name "$env" -q)")
    done
    keys+=("prod-rpm=$("$BIN" keys create --config "$TMP/$name.toml" --env prod --name prod-rpm --rpm 1000000 -q)")
    "$BIN" serve --config "$TMP/$name.toml" >"$TMP/$name.log" 2>&1 &
    STARTED+=($!)
    printf -v "PID_$name" '%s' "$!"
    printf -v "KEYS_$name" '%s' "${keys[*]}"
    printf -v "URL_$name" 'http://127.0.0.1:%s' "$port"
    for _ in $(seq 1 100); do
        curl -fs "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    cat "$TMP/$name.log" >&2
    die "gateway $name did not start"
}
gateway redis redis
gateway local local

log "$REQUESTS requests per (gateway, key), interleaved"
python3 - "$REQUESTS" "$REDIS" "$RUN_DIR/summary.md" \
    "redis|$URL_redis|$PID_redis|$KEYS_redis" "local|$URL_local|$PID_local|$KEYS_local" <<'PY'
import http.client, os, socket, statistics, sys, time, urllib.parse

requests, redis_url, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
tick = os.sysconf("SC_CLK_TCK")

def cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick

body = b'{"model":"qwen32b","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}'
combos = []
gateways = []
for spec in sys.argv[4:]:
    name, url, pid, keys = spec.split("|")
    u = urllib.parse.urlparse(url)
    gateways.append((name, int(pid)))
    for kv in keys.split():
        env, key = kv.split("=", 1)
        conn = http.client.HTTPConnection(u.hostname, u.port)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        combos.append({"gateway": name, "key": env, "conn": conn, "auth": f"Bearer {key}",
                       "gw": [], "client": []})

def send(c):
    t0 = time.perf_counter()
    c["conn"].request("POST", "/v1/chat/completions", body,
                      {"Authorization": c["auth"], "Content-Type": "application/json"})
    r = c["conn"].getresponse()
    r.read()
    took = time.perf_counter() - t0
    if r.status != 200:
        raise SystemExit(f'{c["gateway"]} {c["key"]}: HTTP {r.status}')
    timing = r.getheader("server-timing") or ""
    gw = next(float(p.split("dur=")[1]) for p in timing.split(",") if p.strip().startswith("gw;"))
    return gw, took * 1e3

for c in combos:  # warm-up
    for _ in range(50):
        send(c)
cpu0 = {name: cpu(pid) for name, pid in gateways}
for i in range(requests):
    for c in (combos if i % 2 == 0 else combos[::-1]):
        gw, client = send(c)
        c["gw"].append(gw)
        c["client"].append(client)
cpu1 = {name: cpu(pid) for name, pid in gateways}

# One Redis round trip from this client, for the floor.
u = urllib.parse.urlparse(redis_url)
s = socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
pings = []
for _ in range(requests):
    t0 = time.perf_counter()
    s.sendall(b"PING\r\n")
    s.recv(64)
    pings.append((time.perf_counter() - t0) * 1e3)

def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]

lines = [
    f"{requests} requests per (gateway, key), interleaved; times in ms (Server-Timing gw: the"
    " gateway's own time before the answer's head; client: the whole request on a keep-alive"
    " connection)",
    "",
    "| limits.shared | key | gw p50 | gw p99 | client p50 | client p99 |",
    "|---|---|---|---|---|---|",
]
for c in combos:
    lines.append(f'| {c["gateway"]} | {c["key"]} | {pct(c["gw"], 50):.3f} | {pct(c["gw"], 99):.3f} |'
                 f' {pct(c["client"], 50):.3f} | {pct(c["client"], 99):.3f} |')
lines.append("")
per_gateway = len(combos) // len(gateways) * requests
for name, _ in gateways:
    lines.append(f"- gateway `{name}`: {(cpu1[name] - cpu0[name]) / per_gateway * 1e6:.0f} µs CPU per request"
                 " (user + system, all keys)")
lines.append(f"- Redis PING round trip from the client: p50 {pct(pings, 50):.3f} ms, p99 {pct(pings, 99):.3f} ms")
by = {(c["gateway"], c["key"]): statistics.median(c["gw"]) for c in combos}
for key in ("stress", "prod-rpm"):
    lines.append(f"- {key}: shared − local, gw p50: {(by[('redis', key)] - by[('local', key)]) * 1e3:+.0f} µs")
text = "\n".join(lines) + "\n"
open(out, "w").write(text)
print(text)
PY
