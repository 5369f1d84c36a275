//! Fallbacks: the pool a request goes to when its own cannot serve it (`fallbacks`), or when
//! its prompt is too long for its model (`context_window_fallbacks`). No I/O: the pools and
//! what their backends' cards said.
//!
//! A chain ends: each pool is tried at most once for a request (`tried`), so fallbacks that
//! name each other never loop, and a fallback pool's own fallbacks are followed from it. A
//! fallback is taken only by a key allowed to use it (its model allow-list, the pool's
//! `environments`) whose environment the pool it leaves lets go (`fallback_environments`).

use crate::key::KeyRecord;
use crate::pool::{Fallbacks, Generation, Pool};
use crate::telemetry::fallback::FallbackCause;
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::view::RequestView;

/// The next pool for a request leaving `from` for `cause`: the first of `from`'s fallbacks (of
/// the cause's kind) not yet `tried` that the key may use and, for a context cause, whose
/// context is known to be longer than `from`'s (as its backends report it, after their own
/// refusal) or is not known yet (its backends will say).
pub(crate) fn next<'p>(
    from: &Pool,
    cause: FallbackCause,
    pools: &'p Generation,
    key: Option<&KeyRecord>,
    tried: &[usize],
) -> Option<&'p Pool> {
    let f = from.fallback.as_deref()?;
    let list = if cause.is_context() {
        &f.context_window
    } else {
        &f.on_failure
    };
    // After the engine's own refusal, what its card says counts, not a setting it belied.
    let mine = match cause {
        FallbackCause::ContextError => from.reported_context_length(),
        _ => from.context_length(),
    };
    let longer = |p: &Pool| match (mine, p.context_length()) {
        (Some(mine), Some(theirs)) => theirs > mine,
        _ => true,
    };
    usable(f, list, pools, key)
        .filter(|p| !tried.contains(&p.index))
        .find(|p| !cause.is_context() || longer(p))
}

/// The pool a prompt fits: `pool` when its context holds `needed` tokens (or is not known),
/// else the first of its `context_window_fallbacks` the key may use whose context holds them
/// (or is not known yet). `None`: stay (no fallback fits, and the backend's own answer says
/// why).
pub(crate) fn context_fit<'p>(
    pool: &'p Pool,
    pools: &'p Generation,
    key: Option<&KeyRecord>,
    needed: u64,
) -> Option<&'p Pool> {
    let f = pool.fallback.as_deref()?;
    if f.context_window.is_empty() {
        return None;
    }
    let fits = |p: &Pool| p.context_length().is_none_or(|l| needed <= u64::from(l));
    if fits(pool) {
        return None;
    }
    usable(f, &f.context_window, pools, key).find(|p| fits(p))
}

/// The pools of `list` (one of `f`'s) the key may go to, in order: none when the pool's
/// `fallback_environments` do not let its environment go; then those whose rights it has (the
/// model allow-list, the pool's `environments`).
fn usable<'p, 'a>(
    f: &'a Fallbacks,
    list: &'a [usize],
    pools: &'p Generation,
    key: Option<&'a KeyRecord>,
) -> impl Iterator<Item = &'p Pool> + 'a
where
    'p: 'a,
{
    let may_leave = match (&f.environments, key) {
        (Some(envs), Some(k)) => envs.contains(&k.environment),
        _ => true,
    };
    list.iter()
        .filter(move |_| may_leave)
        .filter_map(|&i| pools.at(i))
        .filter(move |p| key.is_none_or(|k| super::check_rights(k, p).is_ok()))
}

/// The tokens a request needs of a context: its prompt, counted with the pool's tokenizer
/// where it has one (chat and completions), else estimated from its characters, plus the
/// output it asks for (at least one token: vLLM refuses a prompt that fills the context).
pub(crate) fn needed_tokens(
    pool: &Pool,
    view: &RequestView<'_>,
    body: &[u8],
    endpoint: Endpoint,
    estimate: impl Fn(usize) -> u64,
) -> u64 {
    let counted = pool.prompt_tokens.as_ref().and_then(|t| {
        let ids = match endpoint {
            Endpoint::Chat => t.chat(body),
            Endpoint::Completions => super::completion_ids(t, body),
            _ => return None,
        };
        ids.ok().map(|ids| ids.len() as u64)
    });
    let prompt = counted.unwrap_or_else(|| estimate(view.prompt_chars));
    let output = view.max_tokens.unwrap_or(1).max(1);
    prompt.saturating_add(output)
}
