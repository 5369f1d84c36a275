#!/usr/bin/env bash
# How fast is `fleetgate bench` itself? Runs the load generator (its client on one thread) against
# a zero-delay sim and reports requests/s achieved, the client's CPU per request and the rate one
# core could drive at that cost. The sim shares the machine, so the achieved rate is a floor;
# the client's capacity is 1 s / (its CPU per request).
#   scripts/bench-client.sh [extra fleetgate bench flags]
# Environment: PROMPTS (default 30000), CONCURRENCY (default 64), OUTPUT_LEN (default 16).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PROMPTS=${PROMPTS:-30000}
CONCURRENCY=${CONCURRENCY:-64}
OUTPUT_LEN=${OUTPUT_LEN:-16}
BIN="$ROOT/target/release/fleetgate"
cargo build --release -q
OUT="$ROOT/bench-out/client-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$OUT"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$BIN" sim --zero-delay --port "$PORT" --max-num-seqs 4096 >"$OUT/sim.log" 2>&1 &
SIM=$!
trap 'kill $SIM 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
    curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    sleep 0.05
done
SIM_CPU0=$(awk '{print $14+$15}' "/proc/$SIM/stat")
"$BIN" bench --base-url "http://127.0.0.1:$PORT" --model qwen32b --no-progress \
    --num-prompts "$PROMPTS" --random-input-len 16 --random-output-len "$OUTPUT_LEN" \
    --max-concurrency "$CONCURRENCY" --num-warmups 200 --output "$OUT/result.json" "$@" | tee "$OUT/summary.txt"
SIM_CPU1=$(awk '{print $14+$15}' "/proc/$SIM/stat")
python3 - "$OUT/result.json" "$SIM_CPU0" "$SIM_CPU1" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))
n = r["completed"] + r["failed"]
cpu = r["client"]["cpu_us_per_request"]
sim_us = (int(sys.argv[3]) - int(sys.argv[2])) * 10000 / max(n, 1)
print(f"client: {r['request_throughput']:.0f} streamed req/s achieved ({n} requests, {r['failed']} failed), "
      f"{cpu:.0f} µs CPU per request on its one thread -> {1e6 / cpu:.0f} req/s per core; "
      f"sim: {sim_us:.0f} µs CPU per request")
PY
echo "results in $OUT"
