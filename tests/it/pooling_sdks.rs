//! The clients people point at an embedding or reranking fleet, run for real against the
//! gateway in front of a pooling `fleetgate sim`: the OpenAI Python SDK's
//! `embeddings.create` (floats, base64, the SDK's own default and token-id inputs), LangChain's
//! `OpenAIEmbeddings` (PyPI `langchain-openai`), and the plain-HTTP rerank calls of Jina's and
//! Cohere's clients. The sim's numbers are a function of the input, so each answer through the
//! gateway is compared with the sim's own answer to the same request. `.ci/run` installs the
//! Python packages; a missing one skips loudly, and fails under `CI=true`.

use std::process::Stdio;
use std::time::Duration;

use crate::common::*;
use fleetgate_gateway::config::PoolKind;
use fleetgate_gateway::key::Environment;
use fleetgate_sim::{Convert, Runner, SimServer};

const MODEL: &str = "embed-m";
const EMBEDDING_SIZE: u32 = 48;

fn python_has(module: &str) -> bool {
    std::process::Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A gateway in front of an embedding sim (as `vllm serve --runner pooling --convert embed`
/// would be), and a prod key.
async fn setup() -> (SimServer, Gateway, String) {
    let sim = sim(|a| {
        a.runner = Runner::Pooling;
        a.convert = Convert::Embed;
        a.embedding_size = EMBEDDING_SIZE;
        a.served_model_name = vec![MODEL.to_owned()];
    })
    .await;
    let mut p = pool(MODEL, &[sim.url()]);
    p.kind = PoolKind::Embed;
    let gw = gateway(vec![p]).await;
    let (key, _) = issue_key(&gw, Environment::Prod, |_| {}).await;
    (sim, gw, key)
}

/// Runs `script` with `args`; its last line of output must be `ok <n>`, where n is how many
/// requests it sent through the gateway that should have reached the backend. Returns n.
async fn run_python(script: &str, args: &[&str]) -> usize {
    let mut c = std::process::Command::new("python3");
    c.arg("-c")
        .arg(script)
        .args(args)
        // No tracing uploads, no proxy: the only server the script talks to is ours.
        .env_remove("LANGCHAIN_TRACING_V2")
        .env_remove("LANGSMITH_TRACING")
        .env("NO_PROXY", "127.0.0.1,localhost")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let r = output_within(c, Duration::from_secs(60)).await;
    assert!(r.ok, "stdout: {}\nstderr: {}", r.stdout, r.stderr);
    let last = r.stdout.lines().last().unwrap_or_default();
    last.strip_prefix("ok ")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "no `ok <n>` line:\nstdout: {}\nstderr: {}",
                r.stdout, r.stderr
            )
        })
}

/// The gateway recorded `ok` clean answers on `endpoint`, each with the answer's input tokens
/// (the client's requests went through it, not around it, and were measured), and `refused`
/// unauthenticated ones that reached no backend.
async fn recorded(gw: &Gateway, endpoint: &str, ok: usize, refused: usize) {
    let rows = || -> Vec<Seen> {
        gw.records
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.endpoint == Some(endpoint))
            .cloned()
            .collect()
    };
    assert!(
        eventually(Duration::from_secs(5), || rows().len() >= ok + refused).await,
        "{} of {} {endpoint} requests recorded",
        rows().len(),
        ok + refused
    );
    let rows = rows();
    let (good, bad): (Vec<_>, Vec<_>) = rows.iter().partition(|r| r.status == 200);
    assert_eq!(good.len(), ok, "{rows:?}");
    for r in good {
        assert_eq!(r.error, None, "{r:?}");
        assert!(
            r.timeline
                .stream()
                .usage
                .is_some_and(|u| u.prompt_tokens > 0),
            "usage read from the answer: {r:?}"
        );
    }
    assert_eq!(bad.len(), refused, "{rows:?}");
    for r in bad {
        assert_eq!((r.status, r.error), (401, Some("unauthenticated")), "{r:?}");
        assert_eq!(
            r.backend, None,
            "a refused request reached a backend: {r:?}"
        );
    }
}

/// The OpenAI Python SDK's `embeddings.create` through the gateway, compared with the same call
/// straight to the sim: `encoding_format` "float" and "base64" asked explicitly, the SDK's
/// default (it sends "base64" when none is given and decodes the answer to floats itself), one
/// string, and token-id arrays (what LangChain sends by default, after tokenizing with
/// tiktoken). A wrong key is the SDK's AuthenticationError.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_embeds_through_the_gateway() {
    if tool_or_skip(
        "openai_sdk_embeddings",
        "the openai Python SDK",
        python_has("openai"),
    )
    .is_none()
    {
        return;
    }
    let (sim, gw, key) = setup().await;
    let script = r#"
import base64, json, struct, sys
import httpx, openai

gw, sim, key, model, size = sys.argv[1:6]
size = int(size)
texts = ["the license is Apache-2.0", "a color", "the license"]
sent = []  # the bodies the SDK sent to the gateway

def remember(request):
    sent.append(json.loads(request.read()))

via = openai.OpenAI(base_url=gw + "/v1", api_key=key, max_retries=0,
                    http_client=httpx.Client(event_hooks={"request": [remember]}))
direct = openai.OpenAI(base_url=sim + "/v1", api_key="sim-has-no-key", max_retries=0)

def both(inp, **kw):
    a = via.embeddings.create(model=model, input=inp, **kw)
    b = direct.embeddings.create(model=model, input=inp, **kw)
    n = 1 if isinstance(inp, str) or isinstance(inp[0], int) else len(inp)
    for r in (a, b):
        assert r.object == "list" and r.model == model, r
        assert [d.index for d in r.data] == list(range(n)), r.data
        assert r.usage.prompt_tokens > 0, r.usage
    assert a.usage == b.usage, (a.usage, b.usage)
    return a, b

def f32(xs):
    return list(struct.unpack(f"<{len(xs)}f", struct.pack(f"<{len(xs)}f", *xs)))

def unbase64(s):
    raw = base64.b64decode(s)
    assert len(raw) == 4 * size, len(raw)
    return list(struct.unpack(f"<{size}f", raw))

# Floats: the same numbers, one vector of `size` per text.
a, b = both(texts, encoding_format="float")
assert sent[-1]["encoding_format"] == "float", sent[-1]
floats = [d.embedding for d in a.data]
assert all(len(v) == size for v in floats), [len(v) for v in floats]
assert floats == [d.embedding for d in b.data], "float embeddings differ through the gateway"
assert floats[0] != floats[1], "distinct texts, distinct vectors"

# Base64 asked explicitly: the SDK leaves the strings as they came.
a, b = both(texts, encoding_format="base64")
assert sent[-1]["encoding_format"] == "base64", sent[-1]
assert all(isinstance(d.embedding, str) for d in a.data), a.data
assert [d.embedding for d in a.data] == [d.embedding for d in b.data], "base64 differs"
decoded = [unbase64(d.embedding) for d in a.data]
# The same little-endian f32s as the floats (JSON floats rounded to f32).
assert decoded == [f32(v) for v in floats], "base64 and float disagree"

# The SDK's default: what it puts on the wire, and the floats it decodes from that.
a, b = both(texts)
default_format = sent[-1].get("encoding_format")
assert default_format in ("base64", None), sent[-1]
got = [d.embedding for d in a.data]
assert all(isinstance(v, list) and len(v) == size for v in got), got
assert got == [d.embedding for d in b.data], "default-format embeddings differ"
assert [f32(v) for v in got] == decoded, "the SDK's decoding disagrees with base64"

# One string: one vector, the same as that text's in the list.
a, b = both("a color", encoding_format="float")
assert a.data[0].embedding == b.data[0].embedding == floats[1]

# Token ids, one list and several (LangChain's default wire shape).
a, b = both([[11, 12, 13], [14, 15]], encoding_format="float")
assert [len(d.embedding) for d in a.data] == [size, size]
assert [d.embedding for d in a.data] == [d.embedding for d in b.data], "token-id inputs differ"
a, b = both([11, 12, 13], encoding_format="float")
assert a.data[0].embedding == b.data[0].embedding

# A wrong key: the SDK's typed error, from the gateway's OpenAI-shaped body.
bad = openai.OpenAI(base_url=gw + "/v1", api_key="fg-prod-00000000-notakeynotakeynotakey", max_retries=0)
try:
    bad.embeddings.create(model=model, input="hi")
    raise SystemExit("a wrong key embedded")
except openai.AuthenticationError as e:
    assert e.status_code == 401, e

print("default encoding_format sent by openai", openai.__version__, ":", default_format, file=sys.stderr)
print("ok", len(sent))
"#;
    let base = format!("http://{}", gw.server.local_addr);
    let n = run_python(
        script,
        &[&base, &sim.url(), &key, MODEL, &EMBEDDING_SIZE.to_string()],
    )
    .await;
    assert_eq!(n, 6, "six requests through the gateway");
    recorded(&gw, "embeddings", n, 1).await;
}

/// LangChain's `OpenAIEmbeddings` through the gateway: `embed_documents` (in two batches, to
/// check they come back in order) and `embed_query`, compared with the sim's own vectors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn langchain_embeds_documents_and_queries_through_the_gateway() {
    let ok = python_has("langchain_openai") && python_has("openai");
    if tool_or_skip(
        "langchain_embeddings",
        "langchain-openai (PyPI) and the openai Python SDK",
        ok,
    )
    .is_none()
    {
        return;
    }
    let (sim, gw, key) = setup().await;
    let script = r#"
import sys
import openai
from langchain_openai import OpenAIEmbeddings

gw, sim, key, model, size = sys.argv[1:6]
size = int(size)
docs = ["the license is Apache-2.0", "a color", "the license"]

# check_embedding_ctx_length=False sends the texts as they are. Its default (True) tokenizes
# them with tiktoken first and sends token ids; tiktoken downloads its encoding files on first
# use, and this machine reaches no server but the package registries. The token-id wire shape
# is covered by the OpenAI SDK test beside this one. It is also what LangChain advises for
# vLLM, whose model has its own tokenizer (tiktoken's token ids would be another vocabulary).
emb = OpenAIEmbeddings(model=model, base_url=gw + "/v1", api_key=key, max_retries=0,
                       check_embedding_ctx_length=False, chunk_size=2)
vectors = emb.embed_documents(docs)  # two requests: 2 texts, then 1
query = emb.embed_query("the license")  # a third

direct = openai.OpenAI(base_url=sim + "/v1", api_key="sim-has-no-key", max_retries=0)
want = [d.embedding for d in direct.embeddings.create(model=model, input=docs).data]
assert len(vectors) == 3 and all(len(v) == size for v in vectors), [len(v) for v in vectors]
assert vectors == want, "LangChain's vectors differ from the sim's"
assert query == want[2], "embed_query differs from the sim's vector of the same text"
assert vectors[0] != vectors[1]
print("ok 3")
"#;
    let base = format!("http://{}", gw.server.local_addr);
    let n = run_python(
        script,
        &[&base, &sim.url(), &key, MODEL, &EMBEDDING_SIZE.to_string()],
    )
    .await;
    recorded(&gw, "embeddings", n, 0).await;
}

/// Jina's and Cohere's rerank clients are plain HTTP with a bearer key: Jina's
/// `POST /v1/rerank` and Cohere's `POST /v2/rerank`, `{"model","query","documents","top_n"}`.
/// The answer is sorted by relevance, cut to top_n, each result naming its document, and the
/// same as the sim's own; without a key or with a wrong one it is a 401 in OpenAI's shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rerank_clients_over_plain_http_get_sorted_cut_answers() {
    if tool_or_skip("rerank_http", "python3", python_has("urllib.request")).is_none() {
        return;
    }
    let (sim, gw, key) = setup().await;
    let script = r#"
import json, sys, urllib.error, urllib.request

gw, sim, key, model = sys.argv[1:5]
docs = ["the license is Apache-2.0", "a color", "the license", "blue and green",
        "Apache-2.0 or MIT, at your option", "a red apple"]
query = "which license?"
through = 0

def call(base, path, body, key=None):
    global through
    if base == gw:
        through += 1
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if key is not None:
        headers["Authorization"] = "Bearer " + key
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers=headers,
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())

for path in ("/v1/rerank", "/v2/rerank"):  # Jina's, Cohere's
    body = {"model": model, "query": query, "documents": docs, "top_n": 3}
    status, cut = call(gw, path, body, key)
    assert status == 200, (path, status, cut)
    results = cut["results"]
    assert len(results) == 3, (path, results)
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True), (path, scores)
    assert len({r["index"] for r in results}) == 3, results
    for r in results:
        assert r["document"]["text"] == docs[r["index"]], r
    assert cut["usage"]["total_tokens"] > 0, cut

    # All of them without top_n: the cut is the head of the full ranking, which is not the
    # documents' own order.
    full = dict(body)
    del full["top_n"]
    status, whole = call(gw, path, full, key)
    assert status == 200, (path, status, whole)
    ranked = whole["results"]
    assert len(ranked) == len(docs), ranked
    all_scores = [r["relevance_score"] for r in ranked]
    assert all_scores == sorted(all_scores, reverse=True), all_scores
    assert len(set(all_scores)) > 1, "the scores tell the documents apart"
    assert [r["index"] for r in ranked] != list(range(len(docs))), "sorted, not in input order"
    assert ranked[:3] == results, (path, ranked[:3], results)

    # The sim's own answer to the same request (its ids differ per request).
    status, mine = call(sim, path, body)
    assert status == 200, (path, status, mine)
    assert mine["results"] == results and mine["usage"] == cut["usage"], (path, mine, cut)

    # No key, a wrong key: refused by the gateway, in OpenAI's error shape.
    for k in (None, "fg-prod-00000000-notakeynotakeynotakey"):
        status, err = call(gw, path, body, k)
        assert status == 401, (path, k, status, err)
        assert err["error"]["message"], err
        through -= 1  # refused before any backend

print("ok", through)
"#;
    let base = format!("http://{}", gw.server.local_addr);
    let n = run_python(script, &[&base, &sim.url(), &key, MODEL]).await;
    assert_eq!(n, 4, "two reranks through the gateway on each route");
    recorded(&gw, "rerank_v1", 2, 2).await;
    recorded(&gw, "rerank_v2", 2, 2).await;
}
