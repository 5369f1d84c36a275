#!/usr/bin/env python3
"""Records a real vLLM server's KV cache events as a fixture: the raw ZeroMQ frames it publishes
while it serves a few chat requests, what its replay endpoint answers, and vLLM's own
`/tokenize` of each request, so a decoder can be held to the real thing.

    scripts/real-vllm.sh start --kv-events 5557
    scripts/vllm-kv-capture.py --url http://127.0.0.1:PORT --api-key KEY --kv-port 5557 \\
        --out tests/fixtures/vllm-0.32.0/kv-events.json

Run it with the venv's python (it needs pyzmq, which vLLM installs):
`~/.cache/fleetgate/vllm/venv/bin/python scripts/vllm-kv-capture.py ...`.

The requests: a conversation of three turns sharing a system prompt (each turn's prompt
extends the one before, so its blocks chain onto the earlier ones), and one unrelated prompt.
The file holds {"vllm_version", "block_size" (from the first BlockStored), "requests": [{"messages",
"prompt_token_ids" (vLLM's /tokenize with the chat template)}], "frames": [{"topic", "seq",
"payload_hex"}], "replay": {"from", "frames": [{"seq", "payload_hex"}]}}. The API key is never
stored.
"""

import argparse
import json
import time
import urllib.request

import zmq


def post(url, key, path, body):
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def get(url, path):
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return r.read().decode()


SYSTEM = (
    "You are a careful assistant for a team that runs a fleet of inference servers. "
    "Answer briefly, name the metric you rely on, and say when you are unsure. "
) * 6

CONVERSATION = [
    "How do I tell whether the prefix cache is helping?",
    "And if the hit rate is low, what should I change first?",
    "Summarise that in one sentence.",
]

OTHER = "Write a haiku about queues and latency, in the style of an operations runbook."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--kv-port", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    # With an endpoint that names a host (not `*`), vLLM's publisher connects and the
    # subscriber binds ("bind stable, connect volatile"); its replay endpoint always binds.
    monitor = sub.get_monitor_socket(zmq.EVENT_ACCEPTED)
    sub.bind(f"tcp://127.0.0.1:{a.kv_port}")
    # Wait for the publisher to connect, then for it to learn the subscription.
    if not monitor.poll(30_000):
        raise SystemExit(f"vLLM's publisher did not connect to 127.0.0.1:{a.kv_port}")
    monitor.recv_multipart()
    time.sleep(1.0)

    conversations = []
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in CONVERSATION:
        messages.append({"role": "user", "content": turn})
        conversations.append(list(messages))
        answer = post(a.url, a.api_key, "/v1/chat/completions",
                      {"model": "tiny", "messages": messages, "max_tokens": 24,
                       "temperature": 0})
        messages.append({"role": "assistant",
                         "content": answer["choices"][0]["message"]["content"]})
    conversations.append([{"role": "user", "content": OTHER}])
    post(a.url, a.api_key, "/v1/chat/completions",
         {"model": "tiny", "messages": conversations[-1], "max_tokens": 24, "temperature": 0})

    requests = []
    for m in conversations:
        tok = post(a.url, a.api_key, "/tokenize", {"model": "tiny", "messages": m})
        requests.append({"messages": m, "prompt_token_ids": tok["tokens"]})

    frames = []
    deadline = time.time() + 3.0
    while time.time() < deadline:
        if sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            frames.append({"topic": topic.decode(), "seq": int.from_bytes(seq, "big"),
                           "payload_hex": payload.hex()})
            deadline = time.time() + 1.0

    replay_from = frames[0]["seq"] if frames else 0
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{a.kv_port + 1}")
    dealer.send_multipart([b"", replay_from.to_bytes(8, "big")])
    replayed = []
    while dealer.poll(3000):
        parts = dealer.recv_multipart()
        seq_bytes, payload = parts[-2], parts[-1]
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        replayed.append({"seq": seq, "payload_hex": payload.hex()})
        if seq == -1:
            break

    version = json.loads(get(a.url, "/version")).get("version")
    out = {
        "vllm_version": version,
        "captured": time.strftime("%Y-%m-%d"),
        "requests": requests,
        "frames": frames,
        "replay": {"from": replay_from, "frames": replayed},
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"{len(frames)} frames, {len(replayed)} replayed, {len(requests)} requests -> {a.out}")


if __name__ == "__main__":
    main()
