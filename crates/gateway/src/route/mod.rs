//! Model routing: which pool serves a request and with which preferences among its backends.
//! `resolve` turns the client's model name (or an alias) into a pool, checks the key's rights
//! to the model and the pool's environments, moves long prompts to their own pool, and works
//! out the backend preferences (gray keys sent to canary backends first, affinity by user or
//! prompt prefix). No I/O: everything comes from the request view and the current pools.

pub(crate) mod fallback;

use std::sync::Arc;

use crate::auth::AuthFailure;
use crate::config::AffinityBy;
use crate::key::{Environment, KeyRecord};
use crate::pool::hash::fnv1a;
use crate::pool::{Generation, Pool};
use crate::telemetry::fallback::FallbackCause;
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::kv_events::BlockId;
use fleetgate_protocol::view::RequestView;

/// What a request is routed by: its view, its body, its endpoint and the client's headers.
#[derive(Clone, Copy)]
pub(crate) struct Request<'a> {
    pub(crate) view: &'a RequestView<'a>,
    pub(crate) body: &'a [u8],
    pub(crate) endpoint: Endpoint,
    pub(crate) headers: &'a http::HeaderMap,
}

/// The headers agents name their session with: Claude Code's, Codex's, and the common one.
const SESSION_HEADERS: [&str; 3] = ["x-claude-code-session-id", "session_id", "x-session-id"];

/// The hash of the agent session a request belongs to, by the first of `SESSION_HEADERS` it
/// carries (an empty value is none).
fn session(headers: &http::HeaderMap) -> Option<u64> {
    SESSION_HEADERS.iter().find_map(|name| {
        let v = headers.get(*name)?.as_bytes();
        (!v.is_empty()).then(|| fnv1a(v))
    })
}

/// Where a request goes.
#[derive(Debug)]
pub(crate) struct Route<'p> {
    pub(crate) pool: &'p Pool,
    /// Backends to avoid while another can take the request (gray keys sent to the canary
    /// backends); 0: none.
    pub(crate) avoid: u64,
    /// Affinity hash: requests with the same one prefer the same backend (its prefix cache).
    /// On a `kv_events` pool: the agent session's, the tiebreak among the backends holding
    /// as much of the prompt.
    pub(crate) affinity: Option<u64>,
    /// `longest_prefix`: the names of the prompt's blocks (`pool::prefix`), to find the
    /// backend holding the longest of them and to teach the index where the prompt went.
    pub(crate) prefix: Option<Arc<[u64]>>,
    /// `kv_events`: the prompt's full blocks in the engines' own tokens, to find the backend
    /// whose engine holds the longest of them.
    pub(crate) engine_blocks: Option<Arc<EngineBlocks>>,
    /// The backends' own name for the model as a JSON string, when the client named another
    /// (an alias, or the pool's name under a different `served_model_name`): spliced into
    /// the body.
    pub(crate) rename: Option<&'p [u8]>,
    /// The pool is a fallback: why the request left the pool before it, and that pool. The
    /// answer names this pool's model (not the one the client asked for).
    pub(crate) fallback: Option<(FallbackCause, &'p Pool)>,
    /// The backends the request may go to (their bits; 0: any): the holders of the LoRA
    /// adapter it names.
    pub(crate) only: u64,
}

/// A prompt in the engines' blocks: its full blocks (shared, one clone per attempt) and its
/// length in tokens.
/// Shared behind an `Arc` (one pointer in the route and the prepared request, whose futures
/// every request of every pool carries).
#[derive(Debug)]
pub(crate) struct EngineBlocks {
    pub(crate) blocks: Box<[BlockId]>,
    pub(crate) prompt_tokens: u32,
    pub(crate) block_size: u32,
}

impl EngineBlocks {
    /// The prompt tokens an engine holding the first `held` blocks serves from its cache. vLLM
    /// computes the last prompt token again to get its logits, so a prompt fully held is served
    /// up to its last whole block before that token (`(tokens - 1)` rounded down to a block).
    pub(crate) fn cached_tokens(&self, held: usize) -> u32 {
        let most = self.prompt_tokens.saturating_sub(1) / self.block_size.max(1);
        u32::try_from(held)
            .unwrap_or(u32::MAX)
            .min(most)
            .saturating_mul(self.block_size)
    }
}

/// Why a request has no route.
#[derive(Debug, Clone)]
pub(crate) enum RouteError {
    /// No pool serves that name.
    ModelNotFound { model: String, available: String },
    /// The key may not use the model, or its environment may not use the pool (named, with
    /// its metrics index, for the record).
    Denied {
        failure: AuthFailure,
        model: Arc<str>,
        pool_metrics_index: usize,
    },
}

/// Route a request in `pools` (the generation it keeps to its end). `prompt_tokens` estimates
/// a prompt's tokens from its characters (the limits' estimate, so both agree).
pub(crate) fn resolve<'p>(
    request: Request<'_>,
    key: Option<&KeyRecord>,
    pools: &'p Generation,
    prompt_tokens: impl Fn(usize) -> u64,
) -> Result<Route<'p>, RouteError> {
    let Request {
        view,
        body,
        endpoint,
        ..
    } = request;
    let Some(pool) = pools.get(&view.model) else {
        // A LoRA adapter a backend serves: its pool, only the backends holding it.
        return match pools.adapter(&view.model) {
            Some((pool, holders)) => adapter_route(pool, holders, request, key),
            None => Err(RouteError::ModelNotFound {
                model: view.model.clone().into_owned(),
                available: pools.model_list_for(key),
            }),
        };
    };
    if let Some(key) = key
        && let Err(failure) = check_rights(key, pool)
    {
        return Err(RouteError::Denied {
            failure,
            model: pool.model.clone(),
            pool_metrics_index: pool.metrics_index,
        });
    }
    let pool = long_prompt_pool(pool, pools, key, prompt_tokens(view.prompt_chars));
    // A prompt too long for the pool's context goes to the first context-window fallback it
    // fits (only pools with `context_window_fallbacks` count it).
    let needed = || fallback::needed_tokens(pool, view, body, endpoint, &prompt_tokens);
    let moved = pool
        .fallback
        .as_ref()
        .filter(|f| !f.context_window.is_empty() && endpoint.needs().generates)
        .and_then(|_| fallback::context_fit(pool, pools, key, needed()));
    Ok(match moved {
        Some(to) => Route {
            fallback: Some((FallbackCause::ContextWindow, pool)),
            ..route_in(to, request, key)
        },
        None => route_in(pool, request, key),
    })
}

/// The route in `pool` (the key's rights on it already checked): the canary backends gray
/// keys avoid, the affinity or prefix the backend choice goes by, and the rename.
pub(crate) fn route_in<'p>(
    pool: &'p Pool,
    request: Request<'_>,
    key: Option<&KeyRecord>,
) -> Route<'p> {
    let Request {
        view,
        body,
        endpoint,
        headers,
    } = request;
    let avoid = match key {
        Some(k) if k.environment == Environment::Gray => pool.balancer.gray_exclude,
        _ => 0,
    };
    let rename = (*view.model != *pool.served_name).then_some(&*pool.served_json);
    let (affinity, prefix, engine_blocks) = match pool.affinity {
        Some(a) if a.by == AffinityBy::LongestPrefix => {
            (None, prefix_names(pool, body, endpoint), None)
        }
        Some(a) if a.by == AffinityBy::KvEvents => {
            // The agent's session breaks ties (and places a prompt too short for a block).
            let session = session(headers).filter(|_| endpoint.needs().generates);
            (session, None, engine_blocks(pool, body, endpoint))
        }
        _ => (affinity(pool, view, body, endpoint), None, None),
    };
    Route {
        pool,
        avoid,
        affinity,
        prefix,
        engine_blocks,
        rename,
        fallback: None,
        only: 0,
    }
}

/// A request naming a LoRA adapter of `pool`, held by the backends `holders` names: the key
/// may use the adapter (its allow-list names adapters as it names models) and the pool; the
/// body keeps the adapter's name (the backends know it), and no long-prompt pool or fallback
/// takes it (their backends do not hold the adapter).
fn adapter_route<'p>(
    pool: &'p Pool,
    holders: u64,
    request: Request<'_>,
    key: Option<&KeyRecord>,
) -> Result<Route<'p>, RouteError> {
    let adapter = &*request.view.model;
    if let Some(key) = key
        && let Err(failure) = check_adapter_rights(key, pool, adapter)
    {
        return Err(RouteError::Denied {
            failure,
            model: pool.model.clone(),
            pool_metrics_index: pool.metrics_index,
        });
    }
    Ok(Route {
        rename: None,
        only: holders,
        ..route_in(pool, request, key)
    })
}

fn check_adapter_rights(key: &KeyRecord, pool: &Pool, adapter: &str) -> Result<(), AuthFailure> {
    if !key.allows_model(adapter) {
        return Err(AuthFailure::ModelNotAllowed {
            model: adapter.to_owned(),
            allowed: key.allowed_models.clone().unwrap_or_default(),
        });
    }
    check_environment(key, pool)
}

/// The key may use the model, and its environment the pool.
pub(crate) fn check_rights(key: &KeyRecord, pool: &Pool) -> Result<(), AuthFailure> {
    if !key.allows_model(&pool.model) {
        return Err(AuthFailure::ModelNotAllowed {
            model: pool.model.to_string(),
            allowed: key.allowed_models.clone().unwrap_or_default(),
        });
    }
    check_environment(key, pool)
}

/// The key's environment may use the pool.
fn check_environment(key: &KeyRecord, pool: &Pool) -> Result<(), AuthFailure> {
    if let Some(envs) = &pool.environments
        && !envs.contains(&key.environment)
    {
        return Err(AuthFailure::EnvironmentNotAllowed {
            env: key.environment,
            model: pool.model.to_string(),
            allowed: envs.clone(),
        });
    }
    Ok(())
}

/// Long prompts go to their own pool (if the key's environment may use it), so they do not
/// hold up short ones.
fn long_prompt_pool<'p>(
    pool: &'p Pool,
    pools: &'p Generation,
    key: Option<&KeyRecord>,
    prompt_tokens: u64,
) -> &'p Pool {
    if let Some((min_tokens, target)) = pool.long_prompt
        && prompt_tokens >= min_tokens
        && let Some(t) = pools.at(target)
        && key.is_none_or(|k| {
            t.environments
                .as_ref()
                .is_none_or(|e| e.contains(&k.environment))
        })
    {
        return t;
    }
    pool
}

/// The block names of the prompt as the backend will see it: the body from the first of the
/// endpoint's prompt fields on (a template renders tools and the system text before the
/// messages; a body's later fields only change its last blocks). Only for generating
/// endpoints of a pool that routes by longest prefix.
fn prefix_names(pool: &Pool, body: &[u8], endpoint: Endpoint) -> Option<Arc<[u64]>> {
    let index = pool
        .prefix
        .as_ref()
        .filter(|_| endpoint.needs().generates)?;
    let fields = endpoint.prompt_fields();
    let start = fields
        .iter()
        .filter_map(|f| memchr::memmem::find(body, f))
        .min()?;
    Some(Arc::from(index.names(&body[start..])))
}

/// The prompt's full blocks in the engines' tokens: a chat request rendered with the model's
/// template and tokenized, a completions prompt tokenized (or taken as the token ids it is).
/// `None` (routing by load alone) before any engine said its block size, for other endpoints,
/// and for a request the template cannot render.
fn engine_blocks(pool: &Pool, body: &[u8], endpoint: Endpoint) -> Option<Arc<EngineBlocks>> {
    let tokens = pool.prompt_tokens.as_ref()?;
    let block_size = pool
        .backends
        .iter()
        .find_map(|b| b.engine_cache.load().as_ref()?.block_size())?;
    let ids = match endpoint {
        Endpoint::Chat => tokens.chat(body),
        Endpoint::Completions => completion_ids(tokens, body),
        _ => return None,
    };
    match ids {
        Ok(ids) => Some(Arc::new(EngineBlocks {
            blocks: BlockId::of_prompt(&ids, block_size, None).collect(),
            prompt_tokens: u32::try_from(ids.len()).unwrap_or(u32::MAX),
            block_size,
        })),
        Err(why) => {
            tracing::debug!(
                model = &*pool.model,
                why,
                "no engine blocks for this request: routed by load"
            );
            None
        }
    }
}

/// A completions prompt's tokens: a string tokenized, a list of token ids as they are (a
/// batch of several prompts has no one prefix).
fn completion_ids(tokens: &crate::pool::PromptTokens, body: &[u8]) -> Result<Vec<u32>, String> {
    #[derive(serde::Deserialize)]
    struct Completion {
        prompt: serde_json::Value,
    }
    let c: Completion = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let ids = |v: &[serde_json::Value]| {
        v.iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| "a prompt of other than token ids".to_owned())
    };
    match &c.prompt {
        serde_json::Value::String(s) => tokens.completion(s),
        serde_json::Value::Array(items) => match items.as_slice() {
            [serde_json::Value::String(s)] => tokens.completion(s),
            [serde_json::Value::Array(inner)] => ids(inner),
            all if all.first().is_some_and(serde_json::Value::is_u64) => ids(all),
            _ => Err("a batch of prompts".to_owned()),
        },
        _ => Err("no prompt".to_owned()),
    }
}

/// Backend affinity: requests of the same user, or with the same prompt prefix, prefer the
/// same backend (its prefix cache). Computed only for pools that ask for it, and never for
/// tokenization, which leaves nothing in a cache.
fn affinity(pool: &Pool, view: &RequestView<'_>, body: &[u8], endpoint: Endpoint) -> Option<u64> {
    let a = pool.affinity.filter(|_| endpoint.needs().generates)?;
    match a.by {
        AffinityBy::User => view.user.map(|u| fnv1a(u.as_bytes())),
        AffinityBy::LongestPrefix | AffinityBy::KvEvents => None,
        AffinityBy::Prefix => {
            let field = endpoint.prompt_fields().last()?;
            memchr::memmem::find(body, field).map(|at| {
                let end = (at + field.len() + a.prefix_bytes).min(body.len());
                fnv1a(&body[at..end])
            })
        }
    }
}
