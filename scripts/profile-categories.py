#!/usr/bin/env python3
"""Share of a folded-stack profile (inferno-collapse-perf output) by what the time was spent on.

    scripts/profile-categories.py bench-out/profile-<time>/stacks.folded

Each stack goes to the category of its leaf-most frame that matches one (frames are matched
without their generic arguments, so `Dispatcher<…h1::role::Server…>` is hyper's dispatcher, not
head parsing): a malloc inside hyper's flush is allocation, a socket write is a socket write.
Used by profile-stream.sh.
"""
import re
import sys

CATEGORIES = [
    # Kernel stacks are often cut short by the unwinder (no user frames): matched by kernel
    # function names.
    ("kernel: socket writes (send path)", r"writev|sys_write\b|ksys_write|sock_write_iter|tcp_sendmsg|__libc_send|sys_sendto|sys_sendmsg"),
    ("kernel: TCP receive processing (loopback delivery, softirq)", r"tcp_v4_rcv|net_rx_action|softirq|process_backlog|ip_local_deliver|netif_receive"),
    ("kernel: socket reads", r"sys_read\b|ksys_read|recv_with_flags|__libc_recv|sys_recvfrom|sys_recvmsg|tcp_recvmsg|sock_read_iter"),
    ("kernel: epoll (waiting for and collecting events)", r"epoll_wait|do_epoll|ep_poll"),
    ("kernel: futex (waking and parking threads)", r"futex"),
    ("kernel: scheduling (context switches)", r"finish_task_switch|__schedule"),
    ("kernel: accept, connect, close", r"sys_accept|sys_connect|sys_close|__fput|tcp_close"),
    ("kernel: timers, clock", r"clock_gettime|hrtimer|clock_nanosleep|read_tsc"),
    ("kernel: other", r"^\[?k\]|entry_SYSCALL|asm_|irq|page_fault|do_syscall"),
    ("Prometheus metrics", r"prometheus|RequestMetrics|observe"),
    ("SSE scanning", r"SseScanner|openai::sse"),
    ("request body view / JSON", r"openai::view|serde_json"),
    ("request log record", r"request_log"),
    ("Timeline stamps", r"Timeline|timeline"),
    ("hyper: chunked encoding", r"h1::encode|Chunked|ChunkSize"),
    ("hyper: head parsing/writing", r"h1::role|httparse|parse_headers|encode_headers"),
    ("tokio: timers", r"time::Driver|TimerEntry|Sleep|timer"),
    ("allocation (malloc/free)", r"malloc|_int_free|cfree|realloc|__libc_free|alloc::alloc"),
    ("socket reads with kernel receive stamps (fleetgate rx_time)", r"StampedStream|rx_time"),
    ("relay body (fleetgate)", r"RelayBody|proxy::relay"),
    ("proxy request path (fleetgate)", r"fleetgate_gateway::(proxy|route|queue|limits|auth)"),
    ("hyper (other: dispatch, buffers)", r"hyper"),
    ("tokio: scheduler and wake-ups", r"tokio::runtime|tokio::sync"),
]

def strip_generics(frame):
    """`a::B<C, D>::f` -> `a::B::f`; `<X as Y>::f` keeps its X and Y, without their generics."""
    out, depth, i = [], 0, 0
    if frame.startswith("<"):
        # `<X as Y>::rest`: keep the outer brackets, strip inside them.
        out.append("<")
        i = 1
    outer = frame.startswith("<")
    for ch in frame[i:]:
        if ch == "<":
            depth += 1
            continue
        if ch == ">":
            if depth == 0 and outer:
                out.append(">")
                outer = False
            else:
                depth = max(depth - 1, 0)
            continue
        if depth == 0:
            out.append(ch)
    return "".join(out)


COMPILED = [(name, re.compile(pat)) for name, pat in CATEGORIES]


def category(stack):
    for frame in reversed(stack.split(";")):
        f = strip_generics(frame)
        for name, pat in COMPILED:
            if pat.search(f):
                return name
    return "other"


def main(path):
    totals = {}
    all_ = 0
    for line in open(path, encoding="utf-8", errors="replace"):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        try:
            n = int(count)
        except ValueError:
            continue
        all_ += n
        name = category(stack)
        totals[name] = totals.get(name, 0) + n
    print("| where | share of the gateway's CPU samples |")
    print("|---|---|")
    for name, n in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {100.0 * n / max(all_, 1):.1f} % |")


if __name__ == "__main__":
    main(sys.argv[1])
