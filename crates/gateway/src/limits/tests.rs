//! Limiter arithmetic with paused time: every wait below is exact.

use std::time::Duration;

use super::refusal::reset_value;
use super::*;
use crate::config::{EnvLimits, LimitsConfig};

fn key(id: i64, env: Environment) -> KeyRecord {
    KeyRecord {
        id,
        public_id: format!("fg-{}-k{id}", env.as_str()).into(),
        name: format!("key {id}"),
        environment: env,
        secret_hash: [0; 32],
        previous: None,
        created_at: 0,
        created_by: "test".into(),
        expires_at: None,
        revoked_at: None,
        revoked_by: None,
        revoke_reason: None,
        allowed_models: None,
        allowed_endpoints: None,
        requests_per_minute: None,
        tokens_per_minute: None,
        max_concurrent_streams: None,
        metadata: serde_json::Value::Null,
        updated_at: 0,
    }
}

fn limits(envs: [EnvLimits; 3]) -> Arc<Limits> {
    let cfg = LimitsConfig {
        environments: envs,
        ..LimitsConfig::default()
    };
    Arc::new(Limits::new(cfg, None))
}

fn small(n: u64) -> Demand {
    Demand {
        prompt_tokens: n / 2,
        max_tokens: n - n / 2,
    }
}

#[tokio::test(start_paused = true)]
async fn requests_per_minute_with_burst_and_headers() {
    let l = limits(Default::default());
    let mut k = key(1, Environment::Prod);
    k.requests_per_minute = Some(60);
    let mut held = Vec::new();
    for i in 0..60u64 {
        let a = l.hold(&k, small(10)).await.unwrap();
        let w = a.headers.requests.unwrap();
        assert_eq!((w.limit, w.remaining), (60, 59 - i));
        held.push(a);
    }
    let r = l.hold(&k, small(10)).await.unwrap_err();
    assert_eq!(r.kind, LimitKind::KeyRequests);
    assert_eq!(r.retry_after, Some(Duration::from_secs(1)));
    assert_eq!(r.headers.requests.unwrap().remaining, 0);
    assert!(r.message().contains("limit 60"), "{}", r.message());
    tokio::time::advance(Duration::from_millis(999)).await;
    assert!(l.hold(&k, small(10)).await.is_err());
    tokio::time::advance(Duration::from_millis(1)).await;
    let a = l.hold(&k, small(10)).await.unwrap();
    assert_eq!(a.headers.requests.unwrap().remaining, 0);
    // A full minute later the whole burst is back.
    tokio::time::advance(Duration::from_secs(60)).await;
    let a = l.hold(&k, small(10)).await.unwrap();
    assert_eq!(a.headers.requests.unwrap().remaining, 59);
}

#[tokio::test(start_paused = true)]
async fn environment_defaults_and_a_keys_own_values() {
    let mut envs: [EnvLimits; 3] = Default::default();
    envs[Environment::Stress.index()] = EnvLimits {
        requests_per_minute: Some(600),
        request_burst: Some(2),
        ..Default::default()
    };
    let l = limits(envs);
    let plain = key(1, Environment::Stress);
    assert_eq!(l.quota(&plain).requests_per_minute, Some(600));
    assert_eq!(l.quota(&plain).burst, 2);
    assert!(l.hold(&plain, small(1)).await.is_ok());
    assert!(l.hold(&plain, small(1)).await.is_ok());
    let r = l.hold(&plain, small(1)).await.unwrap_err();
    assert_eq!(r.retry_after, Some(Duration::from_millis(100)));
    let mut own = key(2, Environment::Stress);
    own.requests_per_minute = Some(5);
    assert_eq!(l.quota(&own).requests_per_minute, Some(5));
    assert_eq!(l.quota(&own).burst, 5);
    // A prod key is untouched by stress's defaults, and costs no state.
    let before = l.tracked_keys();
    for _ in 0..100 {
        assert!(l.hold(&key(3, Environment::Prod), small(1)).await.is_ok());
    }
    assert_eq!(l.tracked_keys(), before);
}

#[tokio::test(start_paused = true)]
async fn tokens_reserve_then_settle() {
    let l = limits(Default::default());
    let mut k = key(1, Environment::Gray);
    k.tokens_per_minute = Some(1000);
    let demand = Demand {
        prompt_tokens: 100,
        max_tokens: 500,
    };
    let mut first = l.hold(&k, demand).await.unwrap();
    assert_eq!(first.reserved(), 600);
    let w = first.headers.tokens.unwrap();
    assert_eq!((w.limit, w.remaining), (1000, 400));
    let r = l.hold(&k, demand).await.unwrap_err();
    assert_eq!(r.kind, LimitKind::KeyTokens);
    assert_eq!(r.requested, 600);
    // 200 tokens refill at 1000/min in 12 s.
    assert_eq!(r.retry_after, Some(Duration::from_secs(12)));
    // The first request really used 150: 450 come back at once.
    first.set_used(150);
    drop(first);
    let second = l.hold(&k, demand).await.unwrap();
    assert_eq!(second.headers.tokens.unwrap().remaining, 250);
    // Dropped without a known usage: the whole reservation counts.
    drop(second);
    let r = l.hold(&k, demand).await.unwrap_err();
    assert_eq!(r.kind, LimitKind::KeyTokens);
    // More than the whole budget can never pass, and says so.
    let r = l
        .hold(
            &k,
            Demand {
                prompt_tokens: 10,
                max_tokens: 2000,
            },
        )
        .await
        .unwrap_err();
    assert_eq!(r.kind, LimitKind::KeyTokensTooLarge);
    assert_eq!(r.retry_after, None);
    assert!(r.message().contains("never pass"));
}

#[tokio::test(start_paused = true)]
async fn usage_above_the_reservation_is_charged() {
    let l = limits(Default::default());
    let mut k = key(1, Environment::Gray);
    k.tokens_per_minute = Some(1000);
    let mut a = l.hold(&k, small(100)).await.unwrap();
    a.set_used(700);
    drop(a);
    let a = l.hold(&k, small(300)).await.unwrap();
    assert_eq!(a.headers.tokens.unwrap().remaining, 0);
}

#[tokio::test(start_paused = true)]
async fn a_request_refused_by_its_rate_gets_its_tokens_back() {
    let l = limits(Default::default());
    let mut k = key(1, Environment::Prod);
    k.tokens_per_minute = Some(1000);
    k.requests_per_minute = Some(1);
    let _a = l.hold(&k, small(100)).await.unwrap();
    let r = l.hold(&k, small(100)).await.unwrap_err();
    assert_eq!(r.kind, LimitKind::KeyRequests);
    let state = l.keys.get(&1).unwrap().clone();
    assert_eq!(state.tokens.as_ref().unwrap().peek().remaining, 900);
}

#[tokio::test(start_paused = true)]
async fn a_request_that_is_not_inference_counts_only_as_a_request() {
    let mut envs: [EnvLimits; 3] = Default::default();
    envs[Environment::Prod.index()] = EnvLimits {
        aggregate_max_concurrent: Some(1),
        ..Default::default()
    };
    let l = limits(envs);
    let mut k = key(1, Environment::Prod);
    k.requests_per_minute = Some(3);
    k.tokens_per_minute = Some(100);
    k.max_concurrent_streams = Some(1);
    // An inference request holds the key's and the environment's only concurrency places and most tokens.
    let inference = l.hold(&k, small(90)).await.unwrap();
    // Tokenization still passes: no concurrency place, no tokens (none reserved, none needed), one request.
    let a = l.hold_request(&k).await.unwrap();
    assert_eq!((a.reserved(), a.prompt_estimate()), (0, 0));
    assert!(a.headers.tokens.is_none());
    assert_eq!(a.headers.requests.unwrap().remaining, 1);
    drop(a);
    // The key's limiter is the same one (its quota unchanged): the token reservation stands.
    let state = l.keys.get(&1).unwrap().clone();
    assert_eq!(state.tokens.as_ref().unwrap().peek().remaining, 10);
    let _b = l.hold_request(&k).await.unwrap();
    let r = l.hold_request(&k).await.unwrap_err();
    assert_eq!((r.kind, r.requested), (LimitKind::KeyRequests, 0));
    drop(inference);
    // A key and environment without request rates: nothing to check at all.
    let free = key(2, Environment::Stress);
    assert!(l.hold_request(&free).await.unwrap().headers.is_empty());
}

#[tokio::test(start_paused = true)]
async fn concurrency_per_key_and_per_environment() {
    let mut envs: [EnvLimits; 3] = Default::default();
    envs[Environment::Stress.index()] = EnvLimits {
        aggregate_max_concurrent: Some(3),
        ..Default::default()
    };
    let l = limits(envs);
    let mut k = key(1, Environment::Stress);
    k.max_concurrent_streams = Some(2);
    let a = l.hold(&k, small(1)).await.unwrap();
    let b = l.hold(&k, small(1)).await.unwrap();
    let r = l.hold(&k, small(1)).await.unwrap_err();
    assert_eq!((r.kind, r.limit), (LimitKind::KeyConcurrency, 2));
    drop(a);
    let a = l.hold(&k, small(1)).await.unwrap();
    // Another stress key takes the environment's last concurrency place, then the environment is full.
    let other = key(2, Environment::Stress);
    let c = l.hold(&other, small(1)).await.unwrap();
    let r = l.hold(&other, small(1)).await.unwrap_err();
    assert_eq!((r.kind, r.limit), (LimitKind::EnvConcurrency, 3));
    // A refusal by the environment does not keep the key's place.
    drop(b);
    let r = l.hold(&other, small(1)).await;
    assert!(r.is_ok());
    drop((a, c, r));
}

#[tokio::test(start_paused = true)]
async fn environment_aggregate_rate_over_all_keys() {
    let mut envs: [EnvLimits; 3] = Default::default();
    envs[Environment::Stress.index()] = EnvLimits {
        aggregate_requests_per_second: Some(10),
        aggregate_burst: Some(4),
        ..Default::default()
    };
    let l = limits(envs);
    for i in 0..4 {
        assert!(l.hold(&key(i, Environment::Stress), small(1)).await.is_ok());
    }
    let r = l
        .hold(&key(9, Environment::Stress), small(1))
        .await
        .unwrap_err();
    assert_eq!((r.kind, r.limit), (LimitKind::EnvRequests, 10));
    assert_eq!(r.retry_after, Some(Duration::from_millis(100)));
    assert!(r.message().contains("all stress keys together"));
    // prod is not part of stress's aggregate.
    assert!(l.hold(&key(20, Environment::Prod), small(1)).await.is_ok());
    tokio::time::advance(Duration::from_millis(100)).await;
    assert!(l.hold(&key(9, Environment::Stress), small(1)).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn idle_keys_are_pruned_but_not_while_in_flight() {
    let l = limits(Default::default());
    let mut held = None;
    for id in 0..1000 {
        let mut k = key(id, Environment::Stress);
        k.requests_per_minute = Some(100);
        let a = l.hold(&k, small(1)).await.unwrap();
        if id == 7 {
            held = Some(a);
        }
    }
    assert_eq!(l.tracked_keys(), 1000);
    tokio::time::advance(Duration::from_secs(599)).await;
    assert_eq!(l.prune(), 0);
    tokio::time::advance(Duration::from_secs(2)).await;
    assert_eq!(l.prune(), 999);
    assert_eq!(l.tracked_keys(), 1);
    drop(held);
    assert_eq!(l.prune(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_changed_limit_applies_at_once() {
    let l = limits(Default::default());
    let mut k = key(1, Environment::Prod);
    k.requests_per_minute = Some(1);
    assert!(l.hold(&k, small(1)).await.is_ok());
    assert!(l.hold(&k, small(1)).await.is_err());
    k.requests_per_minute = Some(100);
    assert!(l.hold(&k, small(1)).await.is_ok());
}

#[test]
fn demand_estimate() {
    let l = Limits::new(LimitsConfig::default(), None);
    let d = l.demand(4001, Some(100), 2);
    assert_eq!((d.prompt_tokens, d.max_tokens), (1001, 200));
    let d = l.demand(0, None, 1);
    assert_eq!(d.max_tokens, 1024);
}

#[test]
fn reset_header_format() {
    let f = |ms| reset_value(Duration::from_millis(ms));
    assert_eq!(f(0), "0ms");
    assert_eq!(f(120), "120ms");
    assert_eq!(f(1000), "1s");
    assert_eq!(f(1500), "1.5s");
    assert_eq!(f(360_000), "6m0s");
    assert_eq!(f(61_500), "1m1s");
}

/// What a failover carries over: how long a rate or a bucket needs to be whole again, read on
/// one limiter and applied to another (of a different share: the time is the same).
#[tokio::test(start_paused = true)]
async fn rates_and_buckets_carry_their_state_as_time_to_be_whole() {
    use super::bucket::TokenBucket;
    use super::limiter::Gcra;
    use std::num::NonZeroU32;
    let four = NonZeroU32::new(4).unwrap();
    let g = Gcra::new(Duration::from_secs(60), four, four);
    assert_eq!(g.debt(), Duration::ZERO);
    for left in (0..4).rev() {
        assert_eq!(g.check().unwrap().remaining, left);
    }
    assert_eq!(g.debt(), Duration::from_secs(60));
    assert_eq!(g.check(), Err(Duration::from_secs(15)));
    // A fresh limiter told what was used elsewhere starts from there, not from a full burst.
    let fresh = Gcra::new(Duration::from_secs(60), four, four);
    fresh.owe_at_least(g.debt());
    assert_eq!(fresh.check(), Err(Duration::from_secs(15)));
    // It never forgets what it used itself, and owes at most what one check can.
    g.owe_at_least(Duration::ZERO);
    assert_eq!(g.debt(), Duration::from_secs(60));
    let other = Gcra::new(Duration::from_secs(60), four, four);
    other.owe_at_least(Duration::from_secs(3600));
    assert_eq!(other.debt(), Duration::from_secs(60));
    tokio::time::advance(Duration::from_secs(15)).await;
    assert_eq!(g.check().unwrap().remaining, 0);

    let whole = TokenBucket::new(600);
    whole.reserve(300).unwrap();
    assert_eq!(whole.until_full(), Duration::from_secs(30));
    // Half the limit (a replica's share of two) at half the rate: half the tokens missing.
    let share = TokenBucket::new(300);
    share.set_until_full(whole.until_full());
    assert_eq!(share.peek().remaining, 150);
    // A debt carries over as a debt.
    share.set_until_full(Duration::from_secs(90));
    assert_eq!(share.peek().remaining, 0);
    assert_eq!(share.until_full(), Duration::from_secs(90));
}
