#!/usr/bin/env python3
"""Records a real vLLM server's answers as JSON fixtures, one file per case.

    scripts/vllm-capture.py --url http://127.0.0.1:PORT --api-key KEY \
        --out tests/fixtures/vllm-0.32.0

Start the server with scripts/real-vllm.sh (served model `tiny`, max-model-len 1024). Each
file holds {"case", "description", "request": {method, path, auth, headers, body},
"response": {status, headers: {content-type, ...}, body}}; an SSE body is the list of its
`data:` payloads (parsed JSON, or the raw string such as "[DONE]"). A prompt longer than 2 kB
is not stored: the request body holds a placeholder and `request.long_text` tells how to
rebuild it. The API key is never stored. manifest.json lists the cases, the vLLM version
(GET /version) and the capture date.

Standard library only.
"""

import argparse
import datetime
import http.client
import json
import os
import re
import sys
import urllib.parse

WRONG_KEY = "fg-wrong-key"
LONG_LIMIT = 2048  # a request string longer than this is stored as its length
WORD = "the "  # one token per word with the WordLevel tokenizer of real-vllm.sh

# Response headers kept in the fixtures (values); the names of all of them are kept too.
KEPT_HEADERS = ("content-type", "x-request-id", "transfer-encoding")


def chat(messages_or_text, **extra):
    if isinstance(messages_or_text, str):
        messages = [{"role": "user", "content": messages_or_text}]
    else:
        messages = messages_or_text
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "seed": 7}
    body.update(extra)
    return body


def completion(prompt, **extra):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "seed": 7}
    body.update(extra)
    return body


def long_words(count):
    return WORD * count


def cases():
    """(name, description, method, path, body, auth, extra headers, kind)."""
    chat_path, comp_path = "/v1/chat/completions", "/v1/completions"
    c = []

    def add(name, desc, method, path, body=None, auth="key", headers=None, kind="auto"):
        c.append(dict(name=name, description=desc, method=method, path=path, body=body,
                      auth=auth, headers=headers or {}, kind=kind))

    add("health", "GET /health without a key: 200, empty body", "GET", "/health", auth="none")
    add("health_wrong_key", "GET /health with a wrong key: still 200 (no auth on /health)",
        "GET", "/health", auth="wrong")
    add("version", "GET /version", "GET", "/version")
    add("models", "GET /v1/models", "GET", "/v1/models")

    add("chat", "chat completion, not streamed, max_tokens 8", "POST", chat_path,
        chat("Say something about the license."))
    add("chat_x_request_id", "chat completion with an X-Request-Id header (id built from it)",
        "POST", chat_path, chat("Say something about the license."),
        headers={"X-Request-Id": "fleetgate-capture-1"})
    add("chat_stream", "chat streamed, no stream_options: no usage chunk", "POST", chat_path,
        chat("Say something about the license.", stream=True))
    add("chat_stream_include_usage", "chat streamed, stream_options {include_usage: true}",
        "POST", chat_path,
        chat("Say something about the license.", stream=True,
             stream_options={"include_usage": True}))
    add("chat_stream_include_usage_continuous",
        "chat streamed, stream_options {include_usage: true, continuous_usage_stats: true}",
        "POST", chat_path,
        chat("Say something about the license.", stream=True,
             stream_options={"include_usage": True, "continuous_usage_stats": True}))
    add("chat_stream_continuous_only",
        "chat streamed, stream_options {continuous_usage_stats: true} alone",
        "POST", chat_path,
        chat("Say something about the license.", stream=True,
             stream_options={"continuous_usage_stats": True}))

    add("completion", "completion, not streamed, max_tokens 8", "POST", comp_path,
        completion("The license says"))
    add("completion_stream", "completion streamed, no stream_options", "POST", comp_path,
        completion("The license says", stream=True))
    add("completion_stream_include_usage",
        "completion streamed, stream_options {include_usage: true}", "POST", comp_path,
        completion("The license says", stream=True, stream_options={"include_usage": True}))

    add("error_max_tokens_over_max_model_len",
        "max_tokens 5000 > max_model_len 1024: 400, param max_tokens", "POST", chat_path,
        chat("Say something about the license.", max_tokens=5000))
    add("error_prompt_too_long", "a prompt of 1500 words (> 1024 tokens): 400, param input_tokens",
        "POST", chat_path, chat(long_words(1500)))
    add("completion_error_prompt_too_long",
        "completion with a prompt of 1500 words (> 1024 tokens): 400", "POST", comp_path,
        completion(long_words(1500)))
    add("chat_prompt_plus_max_tokens_clamped",
        "prompt of 1000 words + max_tokens 100 > 1024: accepted, clamped, finish_reason length",
        "POST", chat_path, chat(long_words(1000), max_tokens=100))
    add("error_messages_missing", "chat body without messages: 400 (pydantic)", "POST", chat_path,
        {"model": "tiny", "max_tokens": 8})
    add("error_messages_not_list", "chat body with messages a string: 400 (pydantic)", "POST",
        chat_path, {"model": "tiny", "messages": "hello", "max_tokens": 8})
    add("error_invalid_json", "chat body that is not JSON: 400", "POST", chat_path,
        '{"model": "tiny", "messages": [', kind="raw-body")
    add("error_unknown_model", "chat with model nope: 404", "POST", chat_path,
        dict(chat("hello"), model="nope"))
    add("error_wrong_key", "chat with a wrong API key: 401", "POST", chat_path, chat("hello"),
        auth="wrong")
    add("error_no_key", "chat without an Authorization header: 401", "POST", chat_path,
        chat("hello"), auth="none")
    add("models_wrong_key", "GET /v1/models with a wrong API key: 401", "GET", "/v1/models",
        auth="wrong")
    # Last, so the counters include the requests above.
    add("metrics", "GET /metrics (raw text + families with their label names)", "GET",
        "/metrics", auth="none", kind="metrics")
    return c


def shrink(value, path, found):
    """A copy of value with every string over LONG_LIMIT replaced by a placeholder."""
    if isinstance(value, str) and len(value) > LONG_LIMIT:
        entry = {"path": path, "chars": len(value)}
        if value == WORD * (len(value) // len(WORD)):
            entry.update(repeat=WORD, count=len(value) // len(WORD))
        found.append(entry)
        return f"<{len(value)} chars, see request.long_text>"
    if isinstance(value, dict):
        return {k: shrink(v, f"{path}.{k}" if path else k, found) for k, v in value.items()}
    if isinstance(value, list):
        return [shrink(v, f"{path}.{i}", found) for i, v in enumerate(value)]
    return value


def parse_sse(text):
    events = []
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        try:
            events.append(json.loads(payload))
        except ValueError:
            events.append(payload)
    return events


METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
SUFFIXES = ("_bucket", "_sum", "_count", "_created", "_total", "_info", "_gcount", "_gsum")


def parse_metrics(text):
    """Families of a Prometheus text exposition: name, type, help, label names, sample count."""
    families = {}
    order = []

    def family(name):
        if name not in families:
            families[name] = {"name": name, "type": None, "help": None, "labels": set(),
                              "samples": 0}
            order.append(name)
        return families[name]

    for line in text.splitlines():
        if line.startswith("# HELP "):
            parts = line[7:].split(" ", 1)
            family(parts[0])["help"] = parts[1] if len(parts) > 1 else ""
        elif line.startswith("# TYPE "):
            parts = line[7:].split()
            family(parts[0])["type"] = parts[1] if len(parts) > 1 else None
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = METRIC_LINE.match(line)
        if not m:
            continue
        sample = m.group(1)
        name = sample if sample in families else None
        if name is None:
            for suffix in SUFFIXES:
                if sample.endswith(suffix):
                    base = sample[: -len(suffix)]
                    for cand in (base, base + "_total"):
                        if cand in families:
                            name = cand
                            break
                if name:
                    break
        fam = family(name or sample)
        fam["samples"] += 1
        for label, _ in LABEL.findall(m.group(3) or ""):
            fam["labels"].add(label)
    out = []
    for name in order:
        fam = families[name]
        fam["labels"] = sorted(fam["labels"])
        out.append(fam)
    return out


def run_case(base, api_key, case, timeout):
    parsed = urllib.parse.urlsplit(base)
    conn_cls = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parsed.hostname, parsed.port, timeout=timeout)
    headers = {"Accept": "*/*"}
    headers.update(case["headers"])
    if case["auth"] == "key":
        headers["Authorization"] = f"Bearer {api_key}"
    elif case["auth"] == "wrong":
        headers["Authorization"] = f"Bearer {WRONG_KEY}"
    data = None
    if case["body"] is not None:
        data = case["body"] if isinstance(case["body"], str) else json.dumps(case["body"])
        data = data.encode()
        headers["Content-Type"] = "application/json"
    prefix = parsed.path.rstrip("/")
    conn.request(case["method"], prefix + case["path"], body=data, headers=headers)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()

    resp_headers = {k.lower(): v for k, v in resp.getheaders()}
    ctype = resp_headers.get("content-type", "")
    text = raw.decode("utf-8", errors="replace")
    if case["kind"] == "metrics" and resp.status == 200:
        body = {"raw": text, "families": parse_metrics(text)}
    elif "text/event-stream" in ctype:
        body = parse_sse(text)
    elif "json" in ctype:
        try:
            body = json.loads(text)
        except ValueError:
            body = text
    else:
        body = text

    long_text = []
    req_body = case["body"]
    if isinstance(req_body, (dict, list)):
        req_body = shrink(req_body, "", long_text)
    request = {
        "method": case["method"],
        "path": case["path"],
        "auth": {"key": "the server's API key", "wrong": f"Bearer {WRONG_KEY}",
                 "none": "no Authorization header"}[case["auth"]],
        "headers": case["headers"],
        "body": req_body,
    }
    if long_text:
        request["long_text"] = long_text
    response = {
        "status": resp.status,
        "headers": {k: resp_headers[k] for k in KEPT_HEADERS if k in resp_headers},
        "header_names": sorted(resp_headers),
        "body": body,
    }
    return {"case": case["name"], "description": case["description"], "request": request,
            "response": response}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="base URL of vLLM, e.g. http://127.0.0.1:8000")
    ap.add_argument("--api-key", required=True, help="the --api-key vLLM was started with")
    ap.add_argument("--out", required=True, help="directory for the JSON files")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    base = args.url.rstrip("/")
    manifest_cases = []
    version = None
    max_model_len = None
    for case in cases():
        try:
            record = run_case(base, args.api_key, case, args.timeout)
        except (OSError, http.client.HTTPException) as err:
            sys.exit(f"vllm-capture: {case['name']}: {err}")
        body = record["response"]["body"]
        if case["name"] == "version" and isinstance(body, dict):
            version = body.get("version")
        if case["name"] == "models" and isinstance(body, dict) and body.get("data"):
            max_model_len = body["data"][0].get("max_model_len")
        file = case["name"] + ".json"
        with open(os.path.join(args.out, file), "w") as f:
            json.dump(record, f, indent=2, ensure_ascii=False)
            f.write("\n")
        status = record["response"]["status"]
        size = os.path.getsize(os.path.join(args.out, file))
        print(f"{case['name']:40} {status}  {size:7} bytes", file=sys.stderr)
        manifest_cases.append({"case": case["name"], "file": file, "method": case["method"],
                               "path": case["path"], "status": status,
                               "description": case["description"]})

    manifest = {
        "vllm_version": version,
        "captured_at": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
        .isoformat().replace("+00:00", "Z"),
        "served_model_name": "tiny",
        "max_model_len": max_model_len,
        "server": "scripts/real-vllm.sh: vllm serve (CPU build) of a tiny random Llama model, "
                  "--max-model-len 1024 --dtype float32 --enforce-eager --max-num-seqs 16",
        "requests": "max_tokens 8, temperature 0, seed 7 unless the case says otherwise; "
                    "the API key is not stored",
        "cases": manifest_cases,
    }
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print(f"vllm-capture: {len(manifest_cases)} cases written to {args.out} "
          f"(vLLM {version})", file=sys.stderr)


if __name__ == "__main__":
    main()
