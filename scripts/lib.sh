# Shared by the benchmark and profiling scripts (sourced, not run): messages, the processes a
# script starts (stopped when it exits), waiting for a process's address, Debian's nginx and
# its configuration as a plain streaming proxy, a free port.
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

# A port on 127.0.0.1 free at this moment (for nginx, which cannot bind port 0 and say which).
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# CPU time of process PID in ns: the sum over its threads of the scheduler's run time
# (/proc/PID/task/*/schedstat), finer than /proc/PID/stat's 10 ms ticks.
cpu_ns() { cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{s += $1} END {printf "%d\n", s}'; }

# create_key CONFIG NAME LOG: a prod key made with "$BIN" keys (its stderr in LOG), printed.
create_key() {
    local key
    key=$("$BIN" keys --config "$1" create --env prod --name "$2" --json 2>"$3" |
        grep -oE '"key": *"[^"]+"' | head -n1 | sed -E 's/.*"key": *"([^"]+)"/\1/' || true)
    [ -n "$key" ] || {
        cat "$3" >&2
        die "could not create an API key"
    }
    echo "$key"
}

# nginx_proxy_conf DIR PORT UPSTREAM [WORKER_CONNECTIONS] [KEEPALIVE]: writes DIR/nginx.conf, one
# worker proxying 127.0.0.1:PORT to UPSTREAM (http://host:port; several, space-separated, are
# taken round robin) as a plain streaming reverse proxy (no buffering, keep-alive upstream, no
# access log): the floor a hop costs. NGINX_READ_TIMEOUT (e.g. 2000ms) sets proxy_read_timeout
# (nginx's default 60s otherwise). Start it with
#   "$NGINX_BIN" -p "DIR/" -c "DIR/nginx.conf"
nginx_proxy_conf() {
    local dir=$1 port=$2 conns=${4:-1024} keepalive=${5:-64} servers="" u
    for u in $3; do servers+="server ${u#http://}; "; done
    mkdir -p "$dir"
    cat >"$dir/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections $conns; }
http {
    access_log off;
    client_body_temp_path $dir/client_body;
    # Long prompts (an agent's history) are held in memory, as the gateway holds them.
    client_max_body_size 16m;
    client_body_buffer_size 1m;
    proxy_temp_path $dir/proxy;
    tcp_nodelay on;
    upstream backend { ${servers}keepalive $keepalive; }
    server {
        listen 127.0.0.1:$port;
        location / {
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout ${NGINX_READ_TIMEOUT:-60s};
        }
    }
}
EOF
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
