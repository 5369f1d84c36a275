#!/usr/bin/env bash
# Measures the bounds docs/reliability.md (its section on attacks of the release build) states, against a release
# build on 127.0.0.1 only:
#
#   1. RSS under a hostile backend: STREAMS (8) streams at once to a backend that answers each
#      with `data: {"choices":[{"delta":{"content":"` and then LINE_MB (100) MiB with no
#      newline. The gateway's RSS before, its peak (VmHWM) and after; how many bytes the
#      backend wrote per stream before the gateway closed it. Without the line cap the RSS grew
#      by about the line's length per stream.
#   2. Connection places per address: CONNS (600) silent sockets from 127.0.0.1 against a
#      gateway with max_connections = 448 (the derived cap under a 1024-descriptor limit),
#      then how long a request from 127.0.0.2 waits, and how long the admin listener's
#      /healthz takes.
#
#   scripts/attack-bounds.sh            # prints a markdown table; the logs stay in bench-out/
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
STREAMS=${STREAMS:-8}
LINE_MB=${LINE_MB:-100}
CONNS=${CONNS:-600}
# FLEETGATE_BIN: another build to measure (e.g. an earlier commit's); default this checkout's.
BIN=${FLEETGATE_BIN:-"$ROOT/target/release/fleetgate"}
SCRIPT_NAME=attack-bounds
. "$ROOT/scripts/lib.sh"
RUN_DIR="$ROOT/bench-out/attack-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$RUN_DIR"
TMP=$(mktemp -d)
trap 'stop_started; rm -rf "$TMP"' EXIT

[ -n "${FLEETGATE_BIN:-}" ] || cargo build --release --locked -q

# The hostile backend: vLLM's probe routes answered, every chat answered with an endless line.
cat >"$TMP/hostile.py" <<'PY'
import socket, sys, threading
LINE = int(sys.argv[1]) << 20
said = threading.Lock()
def serve(s):
    try:
        head = b""
        while b"\r\n\r\n" not in head:
            d = s.recv(65536)
            if not d:
                return
            head += d
        # (The request line's target, in origin or absolute form: either holds the path.)
        if b"/v1/chat/completions " not in head.split(b"\r\n", 1)[0]:
            body = b'{"object":"list","data":[]}'
            s.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            return
        s.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        first = b'data: {"choices":[{"index":0,"delta":{"content":"'
        s.sendall(b"%x\r\n%s\r\n" % (len(first), first))
        chunk = b"a" * 65536
        frame = b"%x\r\n%s\r\n" % (len(chunk), chunk)
        sent = 0
        try:
            while sent < LINE:
                s.sendall(frame)
                sent += len(chunk)
        except OSError:
            pass
        with said:
            print(sent, flush=True)
    finally:
        s.close()
lst = socket.socket()
lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
lst.bind(("127.0.0.1", 0))
lst.listen(256)
print("listening url=http://127.0.0.1:%d" % lst.getsockname()[1], flush=True)
while True:
    c, _ = lst.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
PY
python3 -u "$TMP/hostile.py" "$LINE_MB" >"$TMP/hostile.log" 2>&1 &
STARTED+=($!)
HOSTILE_URL=$(wait_url "$TMP/hostile.log" "$!" "hostile backend")

ADMIN_PORT=$(free_port)
cat >"$TMP/fleetgate.toml" <<EOF
[server]
listen = "127.0.0.1:0"
request_log_events = false
health_interval_ms = 60000
max_connections = 448
header_timeout_seconds = 30

[request_log]
enabled = false
spill_path = "$TMP/request-log.spill"

[database]
sqlite_path = "$TMP/fleetgate.db"

[admin]
listen = "127.0.0.1:$ADMIN_PORT"

[[pools]]
model = "m"
backends = ["$HOSTILE_URL"]
max_in_flight_per_backend = 0
EOF
KEY=$("$BIN" keys --config "$TMP/fleetgate.toml" create --env prod --name attack -q)
"$BIN" serve --config "$TMP/fleetgate.toml" >"$TMP/fleetgate.log" 2>&1 &
GW_PID=$!
STARTED+=("$GW_PID")
GW_URL=$(wait_url "$TMP/fleetgate.log" "$GW_PID" "fleetgate")
for _ in $(seq 1 100); do curl -sf "$GW_URL/healthz" >/dev/null && break; sleep 0.1; done

rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$GW_PID/status"; }
hwm_kib() { awk '/^VmHWM/ {print $2}' "/proc/$GW_PID/status"; }

# 1. The hostile backend.
BEFORE=$(rss_kib)
CURLS=()
for i in $(seq 1 "$STREAMS"); do
    curl -sN --max-time 120 "$GW_URL/v1/chat/completions" -H "Authorization: Bearer $KEY" \
        -H 'Content-Type: application/json' \
        -d '{"model":"m","stream":true,"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}' \
        | tail -c 400 >"$TMP/stream-$i.tail" &
    CURLS+=($!)
done
wait "${CURLS[@]}"
PEAK=$(hwm_kib)
AFTER=$(rss_kib)
ERRORS=$(grep -l upstream_protocol_error "$TMP"/stream-*.tail | wc -l || true)
# Each stream's writer says how much it wrote once its connection is closed (bounded wait).
for _ in $(seq 1 50); do
    [ "$(grep -cE '^[0-9]+$' "$TMP/hostile.log" || true)" -ge "$STREAMS" ] && break
    sleep 0.1
done
SENT_MAX=$(grep -E '^[0-9]+$' "$TMP/hostile.log" | sort -n | tail -n1 || true)
SENT_MAX=${SENT_MAX:-0}

# 2. Silent sockets from one address, then another address and the admin listener.
python3 - "$GW_URL" "$CONNS" "$ADMIN_PORT" >"$TMP/places.txt" <<'PY'
import socket, sys, time
url, n, admin = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
host, port = url.rsplit("/", 1)[-1].split(":")
port = int(port)
socks = []
for _ in range(n):
    s = socket.socket()
    s.connect((host, port))
    socks.append(s)
time.sleep(1.0)
held = 0
for s in socks:
    s.setblocking(False)
    try:
        held += 0 if s.recv(1) == b"" else 1
    except BlockingIOError:
        held += 1
    except OSError:
        pass
def ask(src, p):
    t = time.monotonic()
    c = socket.socket()
    c.settimeout(60)
    c.bind((src, 0))
    c.connect(("127.0.0.1", p))
    c.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answer = c.recv(64)
    c.close()
    return (time.monotonic() - t) * 1000, answer.split(b"\r\n")[0].decode()
other_ms, other = ask("127.0.0.2", port)
admin_ms, adm = ask("127.0.0.1", admin)
print(f"{held} {other_ms:.1f} {other.replace(' ', '_')} {admin_ms:.1f} {adm.replace(' ', '_')}")
PY
read -r HELD OTHER_MS OTHER ADMIN_MS ADMIN_ANSWER <"$TMP/places.txt"
ADDR_EVENTS=$(curl -s "http://127.0.0.1:$ADMIN_PORT/metrics" | awk '/event="address_limit",listener="api"/ {print $2}')

cp "$TMP/fleetgate.log" "$TMP/hostile.log" "$TMP"/stream-*.tail "$RUN_DIR/"
{
    echo "| measure | value |"
    echo "|---|---|"
    echo "| streams to a backend sending a ${LINE_MB} MiB line with no newline | $STREAMS at once, $ERRORS ended with upstream_protocol_error |"
    echo "| gateway RSS before / peak (VmHWM) / after | $((BEFORE / 1024)) MiB / $((PEAK / 1024)) MiB / $((AFTER / 1024)) MiB |"
    echo "| peak RSS growth per stream | $(((PEAK - BEFORE) / STREAMS)) KiB |"
    echo "| most bytes a backend wrote into one stream before the gateway closed it | $((SENT_MAX / 1024)) KiB (kernel buffers included) |"
    echo "| silent sockets from 127.0.0.1 / held open by the gateway | $CONNS / $HELD (max_connections 448) |"
    echo "| address_limit closes counted | ${ADDR_EVENTS:-0} |"
    echo "| a request from 127.0.0.2 meanwhile | ${OTHER//_/ } in $OTHER_MS ms |"
    echo "| the admin listener's /healthz meanwhile | ${ADMIN_ANSWER//_/ } in $ADMIN_MS ms |"
} | tee "$RUN_DIR/summary.md"
