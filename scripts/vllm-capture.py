#!/usr/bin/env python3
"""Records a real vLLM server's answers as JSON fixtures, one file per case.

    scripts/vllm-capture.py --url http://127.0.0.1:PORT --api-key KEY \
        --out tests/fixtures/vllm-0.32.0 [--only GROUP,GROUP]

Start the server with scripts/real-vllm.sh (served model `tiny`, max-model-len 1024). Each
file holds {"case", "description", "request": {method, path, auth, headers, body},
"response": {status, headers: {content-type, ...}, body}}; an SSE body is the list of its
`data:` payloads (parsed JSON, or the raw string such as "[DONE]"), except for the
/v1/responses and /v1/messages streams, whose body is the list of their events as
{"event": the `event:` line's name (null without one), "data": parsed payload}. A prompt
longer than 2 kB is not stored: the request body holds a placeholder and `request.long_text`
tells how to rebuild it. An id taken from an earlier case's answer (previous_response_id,
/v1/responses/{id}) is stored resolved, and `request.refs` names the case it came from. The
API key is never stored. manifest.json lists the cases, the vLLM version (GET /version) and
the capture date.

Cases come in groups, each needing the server in one mode of scripts/real-vllm.sh:
    base             (start)          health, models, chat and completions, errors, metrics
    responses        (start)          POST/GET /v1/responses and cancel, store not enabled
    messages         (start)          POST /v1/messages (Anthropic), count_tokens
    responses_store  (start --store)  previous_response_id, GET, cancel, background
    agents           (start --agents) tools + tool_choice auto, prompts of 16-20k tokens
    generate_extra   (start)          /v1/chat/completions/batch, and what a generative model
                                      answers on the pooling and audio routes
    pooling          (start --pooling embed)     /v1/embeddings (float, base64, dimensions),
                                      /v2/embed, /pooling, /score, /rerank, their errors, and
                                      what a pooling model answers on chat
    classify         (start --pooling classify)  /classify, /pooling, /score and /rerank
Transcription and translation need a speech-to-text model (Whisper): none can be built offline
here, so no group captures them (docs/testing.md).
Without --only, the groups of the plain server (base, responses, messages) are captured and
manifest.json is rewritten; with --only, just the groups named, and their entries are merged
into the existing manifest.json (other fixtures are left as they are).

Standard library only.
"""

import argparse
import datetime
import http.client
import json
import os
import re
import sys
import time
import urllib.parse

WRONG_KEY = "fg-wrong-key"
LONG_LIMIT = 2048  # a request string longer than this is stored as its length
WORD = "the "  # one token per word with the WordLevel tokenizer of real-vllm.sh

# Response headers kept in the fixtures (values); the names of all of them are kept too.
KEPT_HEADERS = ("content-type", "x-request-id", "transfer-encoding", "content-length")

DEFAULT_GROUPS = ("base", "responses", "messages")
GROUPS = {
    "base": "scripts/real-vllm.sh start",
    "responses": "scripts/real-vllm.sh start",
    "messages": "scripts/real-vllm.sh start",
    "responses_store": "scripts/real-vllm.sh start --store (VLLM_ENABLE_RESPONSES_API_STORE=1)",
    "agents": "scripts/real-vllm.sh start --agents (tiny-llama-32k, --max-model-len 32768 "
              "--enable-auto-tool-choice --tool-call-parser hermes)",
    "generate_extra": "scripts/real-vllm.sh start",
    "pooling": "scripts/real-vllm.sh start --pooling embed (--runner pooling --convert embed; "
               "embedding size 128)",
    "classify": "scripts/real-vllm.sh start --pooling classify (--runner pooling --convert "
                "classify; two labels)",
}
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}


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


def responses(input_, **extra):
    body = {"model": "tiny", "input": input_, "max_output_tokens": 8, "temperature": 0}
    body.update(extra)
    return body


def messages(messages_or_text, **extra):
    if isinstance(messages_or_text, str):
        msgs = [{"role": "user", "content": messages_or_text}]
    else:
        msgs = messages_or_text
    body = {"model": "tiny", "messages": msgs, "max_tokens": 8, "temperature": 0}
    body.update(extra)
    return body


def ref(case):
    """A placeholder for the id of an earlier case's answer (resolved when the case runs)."""
    return "{id:" + case + "}"


# Tools as the clients send them (shortened): OpenAI chat, OpenAI Responses, Anthropic.
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "shell", "description": "Runs a shell command and returns its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {
        "type": "string"}}}, "required": ["command"]}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "shell",
                    "description": "Runs a shell command and returns its output.", "strict": False,
                    "parameters": CHAT_TOOLS[0]["function"]["parameters"]}]
ANTHROPIC_TOOLS = [{"name": "Bash", "description": "Executes a bash command.",
                    "input_schema": {"type": "object", "properties": {"command": {
                        "type": "string"}}, "required": ["command"]}}]


def cases():
    """(name, description, method, path, body, auth, extra headers, kind, group, delay)."""
    chat_path, comp_path = "/v1/chat/completions", "/v1/completions"
    c = []
    group = "base"

    def add(name, desc, method, path, body=None, auth="key", headers=None, kind="auto",
            delay=0.0):
        c.append(dict(name=name, description=desc, method=method, path=path, body=body,
                      auth=auth, headers=headers or {}, kind=kind, group=group, delay=delay))

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
    # Last of the base group, so the counters include the requests above.
    add("metrics", "GET /metrics (raw text + families with their label names)", "GET",
        "/metrics", auth="none", kind="metrics")

    # --- OpenAI Responses API, the server's default (VLLM_ENABLE_RESPONSES_API_STORE unset)
    group = "responses"
    rp = "/v1/responses"
    prompt = "Say something about the license."
    add("responses", "responses, not streamed, max_output_tokens 8 (store defaults to true)",
        "POST", rp, responses(prompt))
    add("responses_stream", "responses streamed: every event with its `event:` name",
        "POST", rp, responses(prompt, stream=True), kind="events")
    add("responses_max_output_tokens_3", "responses with max_output_tokens 3",
        "POST", rp, responses(prompt, max_output_tokens=3))
    add("responses_no_max_output_tokens",
        "responses without max_output_tokens (up to max_model_len - prompt)", "POST", rp,
        {"model": "tiny", "input": prompt, "temperature": 0})
    add("responses_instructions", "responses with instructions (a system message)",
        "POST", rp, responses(prompt, instructions="You are a terse assistant."))
    add("responses_stream_instructions", "responses streamed with instructions",
        "POST", rp, responses(prompt, instructions="You are a terse assistant.", stream=True),
        kind="events")
    add("responses_input_items", "responses with input as a list of message items",
        "POST", rp, responses([{"role": "user", "content": [
            {"type": "input_text", "text": prompt}]}]))
    add("responses_store_false", "responses with store false", "POST", rp,
        responses(prompt, store=False))
    add("responses_previous_response_id",
        "previous_response_id of the first case, store not enabled on the server: 404",
        "POST", rp, responses("And then?", previous_response_id=ref("responses")))
    add("responses_previous_response_id_store_true",
        "same with store true in both requests (the server ignores it): still 404",
        "POST", rp, responses("And then?", store=True,
                              previous_response_id=ref("responses_store_true_first")))
    add("responses_get", "GET /v1/responses/{id} of the first case, store not enabled: 404",
        "GET", rp + "/" + ref("responses"))
    add("responses_get_unknown", "GET /v1/responses/resp_unknown: 404", "GET",
        rp + "/resp_0123456789abcdef")
    add("responses_cancel", "POST /v1/responses/{id}/cancel of the first case: 404 (not stored)",
        "POST", rp + "/" + ref("responses") + "/cancel")
    add("responses_cancel_unknown", "POST /v1/responses/resp_unknown/cancel: 404", "POST",
        rp + "/resp_0123456789abcdef/cancel")
    add("responses_background", "background true (store defaults to true), store not enabled: 400",
        "POST", rp, responses(prompt, background=True))
    add("responses_background_store_false", "background true with store false: 400 (pydantic)",
        "POST", rp, responses(prompt, background=True, store=False))
    add("responses_error_unknown_model", "responses with model nope: 404", "POST", rp,
        dict(responses(prompt), model="nope"))
    add("responses_eos", "responses with logit_bias forcing </s> (id 2): status completed",
        "POST", rp, responses(prompt, logit_bias={"2": 100}))
    add("responses_stream_eos", "streamed, logit_bias forcing </s>: status completed", "POST",
        rp, responses(prompt, logit_bias={"2": 100}, stream=True), kind="events")
    add("responses_no_model", "responses without model (optional: the served one)",
        "POST", rp, {"input": prompt, "max_output_tokens": 8, "temperature": 0})
    add("responses_error_input_missing", "responses without input: 400 (pydantic)", "POST", rp,
        {"model": "tiny", "max_output_tokens": 8})
    add("responses_error_max_output_tokens_over_max_model_len",
        "max_output_tokens 5000 > max_model_len 1024: 400", "POST", rp,
        responses(prompt, max_output_tokens=5000))
    add("responses_error_prompt_too_long", "input of 1500 words (> 1024 tokens): 400", "POST", rp,
        responses(long_words(1500)))
    add("responses_tools_auto_no_parser",
        "responses with function tools and tool_choice auto, server without "
        "--enable-auto-tool-choice", "POST", rp,
        responses(prompt, tools=RESPONSES_TOOLS, tool_choice="auto"))
    add("responses_error_wrong_key", "responses with a wrong API key: 401", "POST", rp,
        responses(prompt), auth="wrong")
    add("responses_error_invalid_json", "responses body that is not JSON: 400", "POST", rp,
        '{"model": "tiny", "input": ', kind="raw-body")
    # Its id is used above: order_cases() runs it before its first user.
    add("responses_store_true_first", "responses with store true explicitly (first of a pair)",
        "POST", rp, responses(prompt, store=True))

    # --- Anthropic Messages API
    group = "messages"
    mp = "/v1/messages"
    ah = ANTHROPIC_HEADERS
    add("messages", "messages, not streamed, max_tokens 8", "POST", mp, messages(prompt),
        headers=ah)
    add("messages_stream", "messages streamed: every event with its `event:` name", "POST", mp,
        messages(prompt, stream=True), headers=ah, kind="events")
    add("messages_beta", "POST /v1/messages?beta=true (as Claude Code sends it)", "POST",
        mp + "?beta=true", messages(prompt), headers=ah)
    add("messages_stream_beta", "streamed, POST /v1/messages?beta=true", "POST",
        mp + "?beta=true", messages(prompt, stream=True), headers=ah, kind="events")
    add("messages_system", "messages with a system string", "POST", mp,
        messages(prompt, system="You are a terse assistant."), headers=ah)
    add("messages_system_blocks", "messages with system as a list of text blocks", "POST", mp,
        messages(prompt, system=[{"type": "text", "text": "You are a terse assistant."}]),
        headers=ah)
    add("messages_content_blocks", "messages with user content as a list of text blocks",
        "POST", mp, messages([{"role": "user", "content": [{"type": "text", "text": prompt}]}]),
        headers=ah)
    add("messages_stop_sequences", "messages with stop_sequences", "POST", mp,
        messages(prompt, stop_sequences=["explanation"], max_tokens=30), headers=ah)
    add("messages_stream_stop_sequences", "messages streamed with stop_sequences", "POST", mp,
        messages(prompt, stop_sequences=["explanation"], max_tokens=30, stream=True),
        headers=ah, kind="events")
    add("messages_error_max_tokens_missing", "messages without max_tokens: 400 (pydantic)",
        "POST", mp, {"model": "tiny", "messages": [{"role": "user", "content": prompt}]},
        headers=ah)
    add("messages_error_max_tokens_zero", "messages with max_tokens 0: 400", "POST", mp,
        messages(prompt, max_tokens=0), headers=ah)
    add("messages_error_max_tokens_over_max_model_len",
        "max_tokens 5000 > max_model_len 1024: 400", "POST", mp,
        messages(prompt, max_tokens=5000), headers=ah)
    add("messages_error_prompt_too_long", "a prompt of 1500 words (> 1024 tokens): 400", "POST",
        mp, messages(long_words(1500)), headers=ah)
    add("messages_error_unknown_model", "messages with model nope: 404", "POST", mp,
        dict(messages(prompt), model="nope"), headers=ah)
    add("messages_error_messages_missing", "messages body without messages: 400 (pydantic)",
        "POST", mp, {"model": "tiny", "max_tokens": 8}, headers=ah)
    add("messages_error_invalid_json", "messages body that is not JSON: 400", "POST", mp,
        '{"model": "tiny", "messages": [', headers=ah, kind="raw-body")
    add("messages_error_wrong_key_bearer", "wrong key as Authorization: Bearer: 401", "POST", mp,
        messages(prompt), auth="wrong", headers=ah)
    add("messages_error_wrong_key_x_api_key",
        "wrong key as x-api-key (no Authorization): 401", "POST", mp, messages(prompt),
        auth="x-api-key-wrong", headers=ah)
    add("messages_x_api_key", "the right key as x-api-key only (as Anthropic clients send it)",
        "POST", mp, messages(prompt), auth="x-api-key", headers=ah)
    add("messages_error_no_key", "no key at all: 401", "POST", mp, messages(prompt), auth="none",
        headers=ah)
    add("messages_tools_auto_no_parser",
        "messages with tools and tool_choice auto, server without --enable-auto-tool-choice",
        "POST", mp, messages(prompt, tools=ANTHROPIC_TOOLS, tool_choice={"type": "auto"}),
        headers=ah)
    add("messages_tools_no_tool_choice",
        "messages with tools and no tool_choice (means auto), server without "
        "--enable-auto-tool-choice", "POST", mp, messages(prompt, tools=ANTHROPIC_TOOLS),
        headers=ah)
    add("messages_tools_none", "messages with tools and tool_choice none", "POST", mp,
        messages(prompt, tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"}), headers=ah)
    add("messages_count_tokens", "POST /v1/messages/count_tokens", "POST", mp + "/count_tokens",
        {"model": "tiny", "messages": [{"role": "user", "content": prompt}]}, headers=ah)
    add("messages_count_tokens_system", "count_tokens with system", "POST",
        mp + "/count_tokens", {"model": "tiny", "system": "You are a terse assistant.",
                               "messages": [{"role": "user", "content": prompt}]}, headers=ah)
    add("messages_count_tokens_system_tools",
        "count_tokens with system and tools", "POST", mp + "/count_tokens",
        {"model": "tiny", "system": "You are a terse assistant.", "tools": ANTHROPIC_TOOLS,
         "messages": [{"role": "user", "content": prompt}]}, headers=ah)
    add("messages_count_tokens_beta", "POST /v1/messages/count_tokens?beta=true", "POST",
        mp + "/count_tokens?beta=true",
        {"model": "tiny", "messages": [{"role": "user", "content": prompt}]}, headers=ah)
    add("messages_count_tokens_unknown_model", "count_tokens with model nope", "POST",
        mp + "/count_tokens", {"model": "nope", "messages": [{"role": "user", "content": prompt}]},
        headers=ah)
    add("messages_count_tokens_wrong_key", "count_tokens with a wrong key: 401", "POST",
        mp + "/count_tokens", {"model": "tiny", "messages": [{"role": "user", "content": prompt}]},
        auth="wrong", headers=ah)

    # --- Responses with the store enabled (start --store)
    group = "responses_store"
    add("responses_store_first", "responses, not streamed (stored: store defaults to true)",
        "POST", rp, responses(prompt))
    add("responses_store_get", "GET /v1/responses/{id} of the first", "GET",
        rp + "/" + ref("responses_store_first"))
    add("responses_store_previous_response_id", "previous_response_id of the first", "POST", rp,
        responses("And then?", previous_response_id=ref("responses_store_first")))
    add("responses_store_previous_response_id_stream",
        "previous_response_id of the first, streamed", "POST", rp,
        responses("And then?", previous_response_id=ref("responses_store_first"), stream=True),
        kind="events")
    add("responses_store_false_then_get", "responses with store false (not stored)", "POST", rp,
        responses(prompt, store=False))
    add("responses_store_get_store_false", "GET of the store false one: 404", "GET",
        rp + "/" + ref("responses_store_false_then_get"))
    add("responses_store_previous_store_false",
        "previous_response_id of the store false one: 404", "POST", rp,
        responses("And then?", previous_response_id=ref("responses_store_false_then_get")))
    add("responses_store_stream", "streamed, stored", "POST", rp,
        responses(prompt, stream=True), kind="events")
    add("responses_store_get_streamed", "GET of the streamed one", "GET",
        rp + "/" + ref("responses_store_stream"))
    add("responses_store_cancel_finished", "cancel of the finished first one: 400", "POST",
        rp + "/" + ref("responses_store_first") + "/cancel")
    add("responses_store_get_unknown", "GET of an unknown id: 404", "GET",
        rp + "/resp_0123456789abcdef")
    add("responses_store_cancel_unknown", "cancel of an unknown id: 404", "POST",
        rp + "/resp_0123456789abcdef/cancel")
    add("responses_store_background", "background true, max_output_tokens 8: answered at once",
        "POST", rp, responses(prompt, background=True))
    add("responses_store_background_get_at_once", "GET of it right away", "GET",
        rp + "/" + ref("responses_store_background"))
    add("responses_store_background_get_later", "GET of it 3 s later", "GET",
        rp + "/" + ref("responses_store_background"), delay=3.0)
    add("responses_store_background_cancel_finished", "cancel of it once finished: 400", "POST",
        rp + "/" + ref("responses_store_background") + "/cancel")
    add("responses_store_background_long", "background true, max_output_tokens 1000 (seconds)",
        "POST", rp, responses(prompt, background=True, max_output_tokens=1000,
                              temperature=1.0))
    add("responses_store_background_cancel", "cancel of it while it runs", "POST",
        rp + "/" + ref("responses_store_background_long") + "/cancel")
    add("responses_store_background_get_cancelled", "GET of it after the cancel", "GET",
        rp + "/" + ref("responses_store_background_long"), delay=1.0)
    add("responses_store_background_cancel_again", "cancel of it again", "POST",
        rp + "/" + ref("responses_store_background_long") + "/cancel")
    add("responses_store_background_stream", "background true and stream true", "POST", rp,
        responses(prompt, background=True, stream=True), kind="events")
    add("responses_store_background_stream_get",
        "GET ?stream=true&starting_after=3 of it (replays the stored events)", "GET",
        rp + "/" + ref("responses_store_background_stream") + "?stream=true&starting_after=3",
        kind="events")
    add("responses_store_get_stream_not_background",
        "GET ?stream=true of the non-background first one: 200, then the connection drops",
        "GET",
        rp + "/" + ref("responses_store_first") + "?stream=true", kind="events")

    # --- Agents mode (start --agents): what coding agents send is accepted
    group = "agents"
    add("agents_models", "GET /v1/models (max_model_len 32768)", "GET", "/v1/models")
    add("agents_chat_tools_auto_20k",
        "chat with tools + tool_choice auto and a prompt of 20000 words", "POST", chat_path,
        chat(long_words(20000), tools=CHAT_TOOLS, tool_choice="auto"))
    add("agents_chat_tools_auto_stream",
        "chat streamed with tools + tool_choice auto", "POST", chat_path,
        chat(prompt, tools=CHAT_TOOLS, tool_choice="auto", stream=True,
             stream_options={"include_usage": True}))
    add("agents_responses_tools_16k",
        "responses (Codex-like) with function tools, tool_choice auto, instructions, "
        "16000 words, store false, streamed", "POST", rp,
        responses([{"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": long_words(16000)}]}],
            instructions="You are a coding agent.", tools=RESPONSES_TOOLS, tool_choice="auto",
            parallel_tool_calls=False, store=False, stream=True,
            include=["reasoning.encrypted_content"]),
        kind="events")
    add("agents_messages_tools_auto_20k",
        "messages (Claude Code-like) with tools, tool_choice auto, system blocks, "
        "20000 words, streamed, ?beta=true", "POST", mp + "?beta=true",
        messages([{"role": "user", "content": [{"type": "text", "text": long_words(20000)}]}],
                 system=[{"type": "text", "text": "You are Claude Code."}],
                 tools=ANTHROPIC_TOOLS, tool_choice={"type": "auto"}, stream=True,
                 max_tokens=32, metadata={"user_id": "capture"}),
        headers=ah, kind="events")
    add("agents_count_tokens_tools", "count_tokens with system and tools (tool_choice unset)",
        "POST", mp + "/count_tokens",
        {"model": "tiny", "system": "You are a terse assistant.", "tools": ANTHROPIC_TOOLS,
         "messages": [{"role": "user", "content": prompt}]}, headers=ah)
    add("agents_messages_tool_result",
        "messages with a tool_use / tool_result turn", "POST", mp,
        messages([{"role": "user", "content": "List the files."},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01",
                                                     "name": "Bash",
                                                     "input": {"command": "ls"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                                "content": "README.md src"}]}],
                 tools=ANTHROPIC_TOOLS, tool_choice={"type": "auto"}), headers=ah)
    add("agents_responses_function_call_output",
        "responses with developer input, a function_call and its function_call_output",
        "POST", rp,
        responses([{"type": "message", "role": "developer", "content": [
                       {"type": "input_text", "text": "Work in the sandbox."}]},
                   {"type": "message", "role": "user", "content": [
                       {"type": "input_text", "text": "List the files."}]},
                   {"type": "function_call", "call_id": "call_1", "name": "shell",
                    "arguments": "{\"command\": [\"ls\"]}"},
                   {"type": "function_call_output", "call_id": "call_1", "output": "README.md"}],
                  tools=RESPONSES_TOOLS, tool_choice="auto", store=False))
    add("agents_error_responses_custom_grammar_tool",
        "responses with a custom tool with a grammar format (Codex's freeform apply_patch): 400",
        "POST", rp,
        responses(prompt, tools=RESPONSES_TOOLS + [{
            "type": "custom", "name": "apply_patch", "description": "Applies a patch.",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}],
            tool_choice="auto", store=False))
    add("agents_error_messages_thinking",
        "messages with thinking enabled, server without --reasoning-parser: 400", "POST",
        mp + "?beta=true", messages(prompt, max_tokens=2048, tools=ANTHROPIC_TOOLS,
                                    thinking={"type": "enabled", "budget_tokens": 1024}),
        headers=ah)
    add("agents_error_prompt_too_long", "chat with 33000 words (> 32768 tokens): 400", "POST",
        chat_path, chat(long_words(33000), tools=CHAT_TOOLS, tool_choice="auto"))

    group = "generate_extra"
    bp = chat_path + "/batch"
    convs = [[{"role": "user", "content": "Say something about the license."}],
             [{"role": "user", "content": "Name a color."}]]
    add("batch_chat", "chat batch: two conversations, one choice each", "POST", bp,
        chat(convs))
    add("batch_chat_stream", "chat batch with stream true", "POST", bp, chat(convs, stream=True))
    add("batch_chat_n2", "chat batch with n 2: 400", "POST", bp, chat(convs, n=2))
    add("batch_chat_messages_not_nested", "chat batch whose messages is one conversation: 400",
        "POST", bp, chat("hello"))
    add("batch_chat_unknown_model", "chat batch naming another model: 404", "POST", bp,
        chat(convs, model="nope"))
    add("batch_chat_no_key", "chat batch without a key: 401", "POST", bp, chat(convs),
        auth="none")
    add("generate_embeddings", "/v1/embeddings on a generative model", "POST",
        "/v1/embeddings", {"model": "tiny", "input": "hello"})
    add("generate_embeddings_no_key", "/v1/embeddings on a generative model, no key", "POST",
        "/v1/embeddings", {"model": "tiny", "input": "hello"}, auth="none")
    add("generate_rerank", "/rerank on a generative model (no key needed off /v1)", "POST",
        "/rerank", {"model": "tiny", "query": "a", "documents": ["b"]}, auth="none")
    add("generate_v2_embed", "/v2/embed on a generative model", "POST", "/v2/embed",
        {"model": "tiny", "texts": ["hello"]})
    add("generate_pooling", "/pooling on a generative model", "POST", "/pooling",
        {"model": "tiny", "input": "hello"})
    add("generate_classify", "/classify on a generative model", "POST", "/classify",
        {"model": "tiny", "input": "hello"})
    add("generate_transcriptions", "/v1/audio/transcriptions on a text-only generative model",
        "POST", "/v1/audio/transcriptions", {"model": "tiny"})

    group = "pooling"
    ep = "/v1/embeddings"
    text = "Say something about the license."
    add("pooling_models", "GET /v1/models of a pooling model", "GET", "/v1/models")
    add("embeddings", "embeddings of one string", "POST", ep, {"model": "tiny", "input": text})
    add("embeddings_list", "embeddings of two strings", "POST", ep,
        {"model": "tiny", "input": [text, "Name a color."]})
    add("embeddings_token_ids", "embeddings of token ids", "POST", ep,
        {"model": "tiny", "input": [5, 6, 7]})
    add("embeddings_token_id_lists", "embeddings of two lists of token ids", "POST", ep,
        {"model": "tiny", "input": [[5, 6, 7], [8, 9]]})
    add("embeddings_base64", "embeddings, encoding_format base64", "POST", ep,
        {"model": "tiny", "input": [text, "Name a color."], "encoding_format": "base64"})
    add("embeddings_no_model", "embeddings without a model", "POST", ep, {"input": text})
    add("embeddings_x_request_id", "embeddings with an X-Request-Id header", "POST", ep,
        {"model": "tiny", "input": text}, headers={"X-Request-Id": "fleetgate-capture-2"})
    add("embeddings_error_dimensions", "embeddings with dimensions 16 (model not matryoshka)",
        "POST", ep, {"model": "tiny", "input": text, "dimensions": 16})
    add("embeddings_error_input_missing", "embeddings without input: 400", "POST", ep,
        {"model": "tiny"})
    add("embeddings_error_unknown_model", "embeddings naming another model", "POST", ep,
        {"model": "nope", "input": text})
    add("embeddings_error_no_key", "embeddings without a key: 401", "POST", ep,
        {"model": "tiny", "input": text}, auth="none")
    add("embeddings_error_wrong_key", "embeddings with a wrong key: 401", "POST", ep,
        {"model": "tiny", "input": text}, auth="wrong")
    add("embeddings_error_prompt_too_long", "embeddings of 1100 words (> 1024 tokens): 400",
        "POST", ep, {"model": "tiny", "input": long_words(1100)})
    add("embeddings_error_invalid_json", "embeddings with a truncated JSON body: 400", "POST",
        ep, '{"model": "tiny", "input": ', kind="raw-body")
    add("embeddings_error_empty_list", "embeddings of an empty list: 400", "POST", ep,
        {"model": "tiny", "input": []})
    add("embed_v2", "Cohere /v2/embed of two texts", "POST", "/v2/embed",
        {"model": "tiny", "texts": [text, "Name a color."], "input_type": "search_document"})
    add("embed_v2_types", "Cohere /v2/embed with embedding_types float, base64, binary",
        "POST", "/v2/embed", {"model": "tiny", "texts": [text],
                              "embedding_types": ["float", "base64", "binary", "ubinary"]})
    add("embed_v2_error_no_texts", "Cohere /v2/embed without texts: 400", "POST", "/v2/embed",
        {"model": "tiny"})
    add("embed_v2_error_no_key", "Cohere /v2/embed without a key: 401", "POST", "/v2/embed",
        {"model": "tiny", "texts": [text]}, auth="none")
    add("pooling_embed", "/pooling of one string (embed model)", "POST", "/pooling",
        {"model": "tiny", "input": text})
    add("pooling_embed_no_key", "/pooling without a key (not under /v1: no auth)", "POST",
        "/pooling", {"model": "tiny", "input": text}, auth="none")
    add("score_queries_documents", "/score with queries and two documents", "POST", "/score",
        {"model": "tiny", "queries": "What is the license?",
         "documents": [text, "Name a color."]})
    add("score_text_1_text_2", "/v1/score with text_1 / text_2", "POST", "/v1/score",
        {"model": "tiny", "text_1": ["a b", "c d"], "text_2": ["a b", "e f"]})
    add("score_queries_items", "/score with queries and items", "POST", "/score",
        {"model": "tiny", "queries": "a b", "items": ["a b", "c"]})
    add("score_error_lengths", "/score with 2 queries and 3 documents: 400", "POST", "/score",
        {"model": "tiny", "queries": ["a", "b"], "documents": ["a", "b", "c"]})
    add("score_error_missing", "/score without documents: 400", "POST", "/score",
        {"model": "tiny", "queries": "a"})
    add("score_v1_no_key", "/v1/score without a key: 401", "POST", "/v1/score",
        {"model": "tiny", "queries": "a", "documents": ["b"]}, auth="none")
    add("rerank", "/rerank of three documents, top_n 2", "POST", "/rerank",
        {"model": "tiny", "query": "What is the license?",
         "documents": [text, "Name a color.", "The license is Apache-2.0."], "top_n": 2})
    add("rerank_v1", "/v1/rerank without top_n", "POST", "/v1/rerank",
        {"model": "tiny", "query": "a b", "documents": ["a b", "c d"]})
    add("rerank_v2", "/v2/rerank", "POST", "/v2/rerank",
        {"model": "tiny", "query": "a b", "documents": ["a b", "c d"], "top_n": 5})
    add("rerank_no_key", "/rerank without a key (not under /v1: no auth)", "POST", "/rerank",
        {"model": "tiny", "query": "a", "documents": ["b"]}, auth="none")
    add("rerank_v2_no_key", "/v2/rerank without a key: 401", "POST", "/v2/rerank",
        {"model": "tiny", "query": "a", "documents": ["b"]}, auth="none")
    add("rerank_error_query_missing", "/rerank without query: 400", "POST", "/rerank",
        {"model": "tiny", "documents": ["b"]})
    add("pooling_classify_route", "/classify on an embedding model", "POST", "/classify",
        {"model": "tiny", "input": text})
    add("pooling_chat", "/v1/chat/completions on a pooling model", "POST", chat_path,
        chat(text))
    add("pooling_completions", "/v1/completions on a pooling model", "POST", comp_path,
        completion(text))
    add("pooling_responses", "/v1/responses on a pooling model", "POST", "/v1/responses",
        responses(text))
    add("pooling_messages", "/v1/messages on a pooling model", "POST", "/v1/messages",
        messages(text), headers=ANTHROPIC_HEADERS)
    add("pooling_batch_chat", "/v1/chat/completions/batch on a pooling model", "POST", bp,
        chat(convs))
    add("pooling_tokenize", "/tokenize on a pooling model", "POST", "/tokenize",
        {"model": "tiny", "prompt": text})
    add("pooling_metrics", "GET /metrics of a pooling model", "GET", "/metrics", auth="none",
        kind="metrics")

    group = "classify"
    add("classify", "/classify of two strings", "POST", "/classify",
        {"model": "tiny", "input": [text, "Name a color."]})
    add("classify_one", "/classify of one string", "POST", "/classify",
        {"model": "tiny", "input": text})
    add("classify_error_input_missing", "/classify without input: 400", "POST", "/classify",
        {"model": "tiny"})
    add("classify_no_key", "/classify without a key (not under /v1: no auth)", "POST",
        "/classify", {"model": "tiny", "input": text}, auth="none")
    add("classify_pooling", "/pooling of one string (classify model)", "POST", "/pooling",
        {"model": "tiny", "input": text})
    add("classify_embeddings", "/v1/embeddings on a classify model", "POST", ep,
        {"model": "tiny", "input": text})
    add("classify_score", "/score on a classify model with two labels", "POST", "/score",
        {"model": "tiny", "queries": "a", "documents": ["b"]})
    add("classify_rerank", "/rerank on a classify model with two labels", "POST", "/rerank",
        {"model": "tiny", "query": "a", "documents": ["b"]})
    return order_cases(c)


def order_cases(c):
    """Moves each case whose id is used by an earlier one just before its first user."""
    names = [case["name"] for case in c]
    out = []
    placed = set()

    def place(case):
        if case["name"] in placed:
            return
        placed.add(case["name"])
        for dep in refs_of(case):
            if dep in names:
                place(c[names.index(dep)])
        out.append(case)

    for case in c:
        place(case)
    return out


REF = re.compile(r"\{id:([a-z0-9_]+)\}")


def refs_of(case):
    text = case["path"] + (json.dumps(case["body"]) if case["body"] is not None else "")
    return REF.findall(text)


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


def parse_sse_events(text):
    """SSE events as {"event": name or None, "data": parsed JSON or raw string}."""
    events = []
    name, data = None, []
    for line in text.replace("\r\n", "\n").split("\n") + [""]:
        if line == "":
            if data or name is not None:
                payload = "\n".join(data)
                try:
                    parsed = json.loads(payload)
                except ValueError:
                    parsed = payload
                events.append({"event": name, "data": parsed})
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:][1:] if line[5:6] == " " else line[5:])
    return events


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


AUTH = {
    "key": "the server's API key",
    "wrong": f"Bearer {WRONG_KEY}",
    "none": "no Authorization header",
    "x-api-key": "the server's API key as x-api-key, no Authorization header",
    "x-api-key-wrong": f"x-api-key: {WRONG_KEY}, no Authorization header",
}


def answer_id(record):
    """The id of a recorded answer: body.id, or the response id of a stream's first event."""
    body = record["response"]["body"]
    if isinstance(body, dict):
        return body.get("id")
    if isinstance(body, list) and body:
        first = body[0].get("data") if isinstance(body[0], dict) and "data" in body[0] else body[0]
        if isinstance(first, dict):
            inner = first.get("response") or first.get("message") or first
            return inner.get("id")
    return None


def resolve(value, records, used):
    """value with each {id:CASE} replaced by the id of that case's answer."""
    if isinstance(value, str):
        def sub(m):
            rec = records.get(m.group(1))
            rid = answer_id(rec) if rec else None
            if not rid:
                raise KeyError(f"no id from case {m.group(1)} (capture it in the same run)")
            used[m.group(1)] = rid
            return rid
        return REF.sub(sub, value)
    if isinstance(value, dict):
        return {k: resolve(v, records, used) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, records, used) for v in value]
    return value


def run_case(base, api_key, case, timeout, records=None):
    used = {}
    case = dict(case, path=resolve(case["path"], records or {}, used),
                body=resolve(case["body"], records or {}, used))
    if case["delay"]:
        time.sleep(case["delay"])
    parsed = urllib.parse.urlsplit(base)
    conn_cls = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parsed.hostname, parsed.port, timeout=timeout)
    headers = {"Accept": "*/*"}
    headers.update(case["headers"])
    if case["auth"] == "key":
        headers["Authorization"] = f"Bearer {api_key}"
    elif case["auth"] == "wrong":
        headers["Authorization"] = f"Bearer {WRONG_KEY}"
    elif case["auth"] == "x-api-key":
        headers["x-api-key"] = api_key
    elif case["auth"] == "x-api-key-wrong":
        headers["x-api-key"] = WRONG_KEY
    data = None
    if case["body"] is not None:
        data = case["body"] if isinstance(case["body"], str) else json.dumps(case["body"])
        data = data.encode()
        headers["Content-Type"] = "application/json"
    prefix = parsed.path.rstrip("/")
    conn.request(case["method"], prefix + case["path"], body=data, headers=headers)
    resp = conn.getresponse()
    broken = None
    try:
        raw = resp.read()
    except http.client.IncompleteRead as err:  # the server dropped the connection mid-body
        raw = err.partial
        broken = (f"the connection closed before the end of the body ({len(err.partial)} bytes "
                  f"read, IncompleteRead)")
    conn.close()

    resp_headers = {k.lower(): v for k, v in resp.getheaders()}
    ctype = resp_headers.get("content-type", "")
    text = raw.decode("utf-8", errors="replace")
    if case["kind"] == "metrics" and resp.status == 200:
        body = {"raw": text, "families": parse_metrics(text)}
    elif "text/event-stream" in ctype and case["kind"] == "events":
        body = parse_sse_events(text)
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
        "auth": AUTH[case["auth"]],
        "headers": case["headers"],
        "body": req_body,
    }
    if long_text:
        request["long_text"] = long_text
    if used:
        request["refs"] = {name: {"case": name, "id": rid} for name, rid in used.items()}
    if case["delay"]:
        request["delay_seconds"] = case["delay"]
    response = {
        "status": resp.status,
        "headers": {k: resp_headers[k] for k in KEPT_HEADERS if k in resp_headers},
        "header_names": sorted(resp_headers),
        "body": body,
    }
    if broken:
        response["broken"] = broken
    return {"case": case["name"], "description": case["description"], "request": request,
            "response": response}


def utc_now():
    return (datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
            .isoformat().replace("+00:00", "Z"))


REQUESTS_NOTE = ("max_tokens 8, temperature 0, seed 7 unless the case says otherwise "
                 "(/v1/responses: max_output_tokens 8, temperature 0; /v1/messages: max_tokens "
                 "8, temperature 0, header anthropic-version 2023-06-01); the API key is not "
                 "stored")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="base URL of vLLM, e.g. http://127.0.0.1:8000")
    ap.add_argument("--api-key", required=True, help="the --api-key vLLM was started with")
    ap.add_argument("--out", required=True, help="directory for the JSON files")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    ap.add_argument("--only", help="comma-separated groups to capture, merged into the existing "
                    "manifest.json: " + ", ".join(GROUPS))
    args = ap.parse_args()

    if args.only:
        groups = [g.strip() for g in args.only.split(",") if g.strip()]
        unknown = [g for g in groups if g not in GROUPS]
        if unknown:
            sys.exit(f"vllm-capture: unknown group(s) {', '.join(unknown)} "
                     f"(known: {', '.join(GROUPS)})")
    else:
        groups = list(DEFAULT_GROUPS)

    os.makedirs(args.out, exist_ok=True)
    base = args.url.rstrip("/")
    all_cases = cases()
    base_names = {case["name"] for case in all_cases if case["group"] == "base"}
    manifest_cases = []
    records = {}
    version = None
    max_model_len = None
    try:
        version = run_case(base, args.api_key, next(c for c in all_cases if c["name"] == "version"),
                           args.timeout)["response"]["body"].get("version")
        models = run_case(base, args.api_key, next(c for c in all_cases if c["name"] == "models"),
                          args.timeout)["response"]["body"]
        max_model_len = models["data"][0].get("max_model_len")
    except (OSError, http.client.HTTPException, AttributeError, KeyError, IndexError,
            TypeError) as err:
        sys.exit(f"vllm-capture: the server does not answer GET /version and /v1/models: {err}")

    for case in all_cases:
        if case["group"] not in groups:
            continue
        try:
            record = run_case(base, args.api_key, case, args.timeout, records)
        except (OSError, http.client.HTTPException, KeyError) as err:
            sys.exit(f"vllm-capture: {case['name']}: {err}")
        records[case["name"]] = record
        # A model card's `root` is the server's local directory: kept as its last component,
        # so no machine's path ends up in the fixtures.
        body = record["response"].get("body")
        if isinstance(body, dict) and isinstance(body.get("data"), list):
            for card in body["data"]:
                if isinstance(card, dict) and isinstance(card.get("root"), str) and card["root"].startswith("/"):
                    card["root"] = os.path.basename(card["root"].rstrip("/"))
        file = case["name"] + ".json"
        with open(os.path.join(args.out, file), "w") as f:
            json.dump(record, f, indent=2, ensure_ascii=False)
            f.write("\n")
        status = record["response"]["status"]
        size = os.path.getsize(os.path.join(args.out, file))
        print(f"{case['name']:48} {status}  {size:7} bytes", file=sys.stderr)
        manifest_cases.append({"case": case["name"], "file": file, "group": case["group"],
                               "method": case["method"], "path": record["request"]["path"],
                               "status": status, "description": case["description"]})

    now = utc_now()
    group_info = {g: {"captured_at": now, "server": GROUPS[g], "max_model_len": max_model_len}
                  for g in groups}
    path = os.path.join(args.out, "manifest.json")
    if args.only and os.path.exists(path):
        with open(path) as f:
            manifest = json.load(f)
        new = {entry["case"]: entry for entry in manifest_cases}
        merged = []
        for entry in manifest.get("cases", []):
            if entry["case"] in new:
                merged.append(new.pop(entry["case"]))
            else:
                if "group" not in entry and entry["case"] in base_names:
                    entry = dict(entry, group="base")
                merged.append(entry)
        merged.extend(entry for entry in manifest_cases if entry["case"] in new)
        manifest["cases"] = merged
        manifest["requests"] = REQUESTS_NOTE
        manifest.setdefault("groups", {})
        if "base" not in manifest["groups"] and "base" not in groups:
            manifest["groups"]["base"] = {"captured_at": manifest.get("captured_at"),
                                          "server": GROUPS["base"],
                                          "max_model_len": manifest.get("max_model_len")}
        manifest["groups"].update(group_info)
        if manifest.get("vllm_version") != version:
            print(f"vllm-capture: warning: manifest.json says vLLM {manifest.get('vllm_version')}, "
                  f"the server is {version}", file=sys.stderr)
    else:
        manifest = {
            "vllm_version": version,
            "captured_at": now,
            "served_model_name": "tiny",
            "max_model_len": max_model_len,
            "server": "scripts/real-vllm.sh: vllm serve (CPU build) of a tiny random Llama model, "
                      "--max-model-len 1024 --dtype float32 --enforce-eager --max-num-seqs 16",
            "requests": REQUESTS_NOTE,
            "groups": group_info,
            "cases": manifest_cases,
        }
    with open(path, "w") as f:
        json.dump(manifest, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print(f"vllm-capture: {len(manifest_cases)} cases ({', '.join(groups)}) written to "
          f"{args.out} (vLLM {version}); manifest.json lists {len(manifest['cases'])}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
