# Shared by the benchmark and profiling scripts (sourced, not run): messages, the processes a
# script starts (stopped when it exits), waiting for a process's address, Debian's nginx.
#
#   SCRIPT_NAME=bench-hop
#   . "$ROOT/scripts/lib.sh"
#   some-server ... & STARTED+=($!)
#   trap 'stop_started; rm -rf "$TMP"' EXIT

log() { echo "${SCRIPT_NAME:-fleetgate}: $*" >&2; }
die() {
    log "$*"
    exit 1
}

# Pids of the processes the script started.
STARTED=()

# TERM every started process, wait up to 5 s for them to exit, then KILL the rest.
stop_started() {
    local pid alive
    for pid in "${STARTED[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for _ in $(seq 1 50); do
        alive=0
        for pid in "${STARTED[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for pid in "${STARTED[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
}

# wait_url LOG PID NAME: the URL a process logs once it listens ("... listening
# url=http://127.0.0.1:PORT"), waited for at most 10 s.
wait_url() {
    local file=$1 pid=$2 name=$3 url
    for _ in $(seq 1 100); do
        url=$(grep listening "$file" 2>/dev/null | grep -oE 'http://127\.0\.0\.1:[0-9]+' | head -n1 || true)
        if [ -n "$url" ]; then
            echo "$url"
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || { cat "$file" >&2; die "$name exited during start"; }
        sleep 0.1
    done
    cat "$file" >&2
    die "$name did not report its address within 10 s"
}

# Sets NGINX_BIN, installing Debian's nginx when it is missing.
find_nginx() {
    NGINX_BIN=$(command -v nginx 2>/dev/null || { [ -x /usr/sbin/nginx ] && echo /usr/sbin/nginx; } || true)
    [ -n "$NGINX_BIN" ] && return 0
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    log "installing Debian's nginx"
    $sudo apt-get update -q
    # RUNLEVEL=1 keeps the package's init script from starting a system nginx on port 80.
    $sudo env RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx-light ||
        $sudo env RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx
    NGINX_BIN=$(command -v nginx 2>/dev/null || { [ -x /usr/sbin/nginx ] && echo /usr/sbin/nginx; } || true)
    [ -n "$NGINX_BIN" ] || die "nginx is still missing after apt-get install"
}

# chat_lua FILE KEY: a wrk script sending a chat completion of max_tokens 16, not streamed, to
# model qwen32b with KEY (the throughput pass of bench-hop.sh, LOAD=plain of profile-stream.sh).
chat_lua() {
    cat >"$1" <<LUA
wrk.method = "POST"
wrk.body = '{"model":"qwen32b","max_tokens":16,"messages":[{"role":"user","content":"hello"}]}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer $2"
LUA
}
