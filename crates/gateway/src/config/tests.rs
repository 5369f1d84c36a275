//! Parsing and validation of whole config files: defaults, field paths of mistakes, env
//! interpolation, reload differences and the example config.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use super::backends::DEFAULT_DNS_INTERVAL;
use super::server::DEFAULT_MAX_BODY_BYTES;
use super::*;
use crate::secret::Secret;

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse("t.toml", text, |n| {
        (n == "KEY").then(|| "sekrit".to_owned())
    })
}

#[test]
fn minimal_config_gets_defaults() {
    let c = parse("[[pools]]\nmodel='m'\nbackends=['http://127.0.0.1:8001/v1/']\n").unwrap();
    assert_eq!(c.server.listen.port(), 8080);
    assert_eq!(c.server.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
    assert_eq!(
        c.pools[0].backends[0].url.to_string(),
        "http://127.0.0.1:8001/"
    );
    assert_eq!(c.pools[0].timeouts.connect, Duration::from_secs(3));
}

#[test]
fn dns_discovery_entries_and_their_mistakes() {
    let c = parse(
        "[[pools]]\nmodel='m'\nbackends=[{url='http://vllm.ns.svc:8000', discover='dns', refresh_interval_ms=2000, labels=['a']}]\n",
    )
    .unwrap();
    assert_eq!(
        c.pools[0].backends[0].discover,
        Discover::Dns {
            interval: Duration::from_secs(2)
        }
    );
    let d = parse("[[pools]]\nmodel='m'\nbackends=[{url='http://vllm:8000', discover='dns'}]\n")
        .unwrap();
    assert_eq!(
        d.pools[0].backends[0].discover,
        Discover::Dns {
            interval: DEFAULT_DNS_INTERVAL
        }
    );
    for (backend, field, says) in [
        (
            "{url='https://vllm:8000', discover='dns'}",
            ".url",
            "needs http://",
        ),
        (
            "{url='http://10.0.0.5:8000', discover='dns'}",
            ".url",
            "host name",
        ),
        (
            "{url='http://vllm:8000', discover='srv'}",
            ".discover",
            "not a discovery mode",
        ),
        (
            "{url='http://vllm:8000', refresh_interval_ms=100}",
            ".refresh_interval_ms",
            "only with discover",
        ),
        (
            "{url='http://vllm:8000', discover='dns', refresh_interval_ms=5}",
            ".refresh_interval_ms",
            "at least 100",
        ),
    ] {
        let e = parse(&format!("[[pools]]\nmodel='m'\nbackends=[{backend}]\n")).unwrap_err();
        assert_eq!(e.field, format!("pools[0].backends[0]{field}"), "{backend}");
        assert!(e.message.contains(says), "{backend}: {}", e.message);
    }
}

#[test]
fn a_reload_names_the_sections_that_need_a_restart() {
    let a = parse("[[pools]]\nmodel='m'\nbackends=['http://a:1']\n").unwrap();
    let b = parse("[queue]\nmax_size=9\n[[pools]]\nmodel='n'\nbackends=['http://b:1']\n").unwrap();
    assert_eq!(a.restart_needed_for(&b), ["[queue]"]);
    assert!(a.restart_needed_for(&a).is_empty());
}

#[test]
fn a_changed_secret_alone_needs_a_restart() {
    let pool = "[[pools]]\nmodel='m'\nbackends=['http://a:1']\n";
    let with = |section: &str| parse(&format!("{section}{pool}")).unwrap();
    let db = |url: &str| with(&format!("[database]\nurl='{url}'\n"));
    let a = db("postgres://fg:one@db/fleet");
    let b = db("postgres://fg:two@db/fleet");
    assert_eq!(format!("{:?}", a.database), format!("{:?}", b.database));
    assert_eq!(a.restart_needed_for(&b), ["[database]"]);
    assert!(a.restart_needed_for(&a.clone()).is_empty());

    let jwt = |secret: &str| with(&format!("[admin]\njwt_secret='{secret}'\n"));
    let a = jwt(&"a".repeat(32));
    let b = jwt(&"b".repeat(32));
    assert_eq!(format!("{:?}", a.admin), format!("{:?}", b.admin));
    assert_eq!(a.restart_needed_for(&b), ["[admin]"]);
    assert!(a.restart_needed_for(&a.clone()).is_empty());
}

#[test]
fn head_limits_keep_the_listener_above_what_is_forwarded() {
    let pool = "[[pools]]\nmodel='m'\nbackends=['http://a:1']\n";
    let c = parse(pool).unwrap();
    assert_eq!(c.server.max_request_head_bytes, 64 * 1024);
    assert_eq!(c.server.max_upstream_head_bytes, 15 * 1024);
    assert_eq!(c.server.max_upstream_header_value_bytes, 7 * 1024 + 512);
    for (server, field, says) in [
        (
            "max_request_head_bytes=4096",
            "server.max_request_head_bytes",
            "between 8192",
        ),
        (
            "max_request_head_bytes=16384\nmax_upstream_head_bytes=32768",
            "server.max_upstream_head_bytes",
            "at most server.max_request_head_bytes",
        ),
        (
            "max_upstream_head_bytes=4096\nmax_upstream_header_value_bytes=8192",
            "server.max_upstream_header_value_bytes",
            "at most server.max_upstream_head_bytes",
        ),
    ] {
        let e = parse(&format!("[server]\n{server}\n{pool}")).unwrap_err();
        assert_eq!(e.field, field, "{server}");
        assert!(e.message.contains(says), "{server}: {}", e.message);
    }
}

#[test]
fn the_listen_backlog_defaults_to_a_storms_worth_and_refuses_zero() {
    let pool = "[[pools]]\nmodel='m'\nbackends=['http://a:1']\n";
    assert_eq!(parse(pool).unwrap().server.listen_backlog, 4096);
    let c = parse(&format!("[server]\nlisten_backlog = 65535\n{pool}")).unwrap();
    assert_eq!(c.server.listen_backlog, 65535);
    for bad in ["0", "4294967295"] {
        let e = parse(&format!("[server]\nlisten_backlog = {bad}\n{pool}")).unwrap_err();
        assert_eq!(e.field, "server.listen_backlog", "{bad}");
        assert!(e.message.contains("net.core.somaxconn"), "{}", e.message);
    }
}

#[test]
fn unknown_field_names_its_path() {
    let e =
        parse("[server]\nlisen='x'\n[[pools]]\nmodel='m'\nbackends=['http://a']\n").unwrap_err();
    assert_eq!(e.field, "server.lisen");
    assert!(e.message.contains("lisen"), "{e}");
}

#[test]
fn bad_backend_names_index() {
    let e = parse("[[pools]]\nmodel='m'\nbackends=['http://a', '10.0.0.1:8000']\n").unwrap_err();
    assert_eq!(e.field, "pools[0].backends[1]");
    assert!(e.message.contains("scheme"), "{e}");
}

#[test]
fn env_interpolation_and_secret_hidden() {
    let c =
        parse("[[pools]]\nmodel='m'\nbackends=['http://a']\nupstream_api_key='${KEY}'\n").unwrap();
    let key = c.pools[0].upstream_api_key.as_ref().unwrap();
    assert_eq!(key.expose(), "sekrit");
    assert_eq!(format!("{key:?} {key}"), "***** *****");
    let e = parse("[[pools]]\nmodel='m'\nbackends=['http://a']\nupstream_api_key='${NOPE}'\n")
        .unwrap_err();
    assert!(e.message.contains("NOPE"));
    let c = parse(
        "[server]\nlisten='${NOPE:-127.0.0.1:9}'\n[[pools]]\nmodel='m'\nbackends=['http://a']\n",
    )
    .unwrap();
    assert_eq!(c.server.listen.port(), 9);
}

#[test]
fn duplicate_model_and_empty_pools_rejected() {
    assert_eq!(parse("").unwrap_err().field, "pools");
    let e = parse("[[pools]]\nmodel='m'\nbackends=['http://a']\n[[pools]]\nmodel='m'\nbackends=['http://b']\n").unwrap_err();
    assert_eq!(e.field, "pools[1].model");
}

#[test]
fn backend_tables_aliases_retries_and_ejection() {
    let c = parse(
        "[[pools]]\nmodel='m'\naliases=['old-m']\nbackends=['http://a:1', {url='http://b:2/v1', weight=3, capacity=8, labels=['canary'], upstream_api_key='k'}]\n[pools.retries]\nmax_retries=1\nbudget_percent=10\n[pools.ejection]\nconsecutive_failures=5\nbase_ms=200\nmax_ms=400\n",
    )
    .unwrap();
    let p = &c.pools[0];
    assert_eq!(p.aliases, ["old-m"]);
    assert_eq!(p.backends[0].weight, 1);
    let b = &p.backends[1];
    assert_eq!(b.url.to_string(), "http://b:2/");
    assert_eq!((b.weight, b.capacity), (3, Some(8)));
    assert_eq!(b.labels, ["canary"]);
    assert_eq!(b.upstream_api_key.as_ref().map(Secret::expose), Some("k"));
    assert_eq!(p.retries.max_retries, 1);
    assert!((p.retries.budget_ratio - 0.1).abs() < 1e-9);
    assert_eq!(p.ejection.consecutive_failures, 5);
    let e = parse("[[pools]]\nmodel='m'\nbackends=[{url='http://a', weight=0}]\n").unwrap_err();
    assert_eq!(e.field, "pools[0].backends[0].weight");
    let e = parse("[[pools]]\nmodel='m'\nbackends=['http://a', 'http://a/']\n").unwrap_err();
    assert!(e.message.contains("listed twice"), "{e}");
    let e = parse(
        "[[pools]]\nmodel='m'\nbackends=['http://a']\n[[pools]]\nmodel='n'\naliases=['m']\nbackends=['http://b']\n",
    )
    .unwrap_err();
    assert_eq!(e.field, "pools[1].aliases[0]");
    let e = parse("[[pools]]\nmodel='m'\nbackends=[{url='http://a', wieght=2}]\n").unwrap_err();
    assert!(e.field.starts_with("pools[0].backends"), "{e}");
    assert!(e.message.contains("wieght"), "the typo is named: {e}");
}

#[test]
fn example_config_is_valid() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/fleetgate.toml");
    let c = Config::load(&path).unwrap();
    assert_eq!(c.server.listen, SocketAddr::from(([127, 0, 0, 1], 8080)));
    assert_eq!(c.pools[0].backends.len(), 2);
}

#[test]
fn auth_brake_defaults_and_its_mistakes() {
    const POOLS: &str = "[[pools]]\nmodel='m'\nbackends=['http://a']\n";
    let c = parse(POOLS).unwrap();
    assert_eq!(c.auth, AuthConfig::default());
    let c = parse(&format!(
        "[auth]\nfailure_delay_ms=250\nthrottle_delay_ms=2000\nmax_delayed_answers=50\n{POOLS}"
    ))
    .unwrap();
    assert_eq!(c.auth.failure_delay, Duration::from_millis(250));
    assert_eq!(c.auth.throttle_delay, Duration::from_secs(2));
    assert_eq!(c.auth.max_delayed_answers, 50);
    for (auth, field) in [
        ("failures_per_minute=0", "auth.failures_per_minute"),
        ("failure_delay_ms=60000", "auth.failure_delay_ms"),
        ("throttle_delay_ms=600000", "auth.throttle_delay_ms"),
        (
            "failure_delay_ms=500\nthrottle_delay_ms=100",
            "auth.throttle_delay_ms",
        ),
        ("max_delayed_answers=0", "auth.max_delayed_answers"),
    ] {
        let e = parse(&format!("[auth]\n{auth}\n{POOLS}")).unwrap_err();
        assert_eq!(e.field, field, "{auth}: {e}");
    }
}

#[test]
fn the_gray_canary_label_is_read_under_its_former_name_too() {
    let pool = |keys: &str| {
        format!(
            "[[pools]]\nmodel = \"m\"\n{keys}\nbackends = [{{ url = \"http://a:1\", labels = [\"canary\"] }}, \"http://b:1\"]\n"
        )
    };
    let now = parse(&pool("gray_canary_label = \"canary\"")).unwrap();
    assert_eq!(now.pools[0].gray_canary_label.as_deref(), Some("canary"));
    let before = parse(&pool("gray_pin_label = \"canary\"")).unwrap();
    assert_eq!(before.pools[0].gray_canary_label.as_deref(), Some("canary"));
    let both = parse(&pool(
        "gray_canary_label = \"canary\"\ngray_pin_label = \"canary\"",
    ))
    .unwrap_err()
    .to_string();
    assert!(both.contains("pools[0].gray_pin_label"), "{both}");
    assert!(both.contains("give only gray_canary_label"), "{both}");
    let unknown = parse(&pool("gray_canary_label = \"nope\""))
        .unwrap_err()
        .to_string();
    assert!(unknown.contains("pools[0].gray_canary_label"), "{unknown}");
}

#[test]
fn kv_events_and_their_mistakes() {
    let dir = std::env::temp_dir().join(format!("fleetgate-kv-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
    let pool = "[[pools]]\nmodel='m'\nbackends=['http://a:8000', {url='http://b:8000', kv_events_port=6000}]\n";
    let c = parse(&format!(
        "{pool}[pools.affinity]\nby='kv_events'\n[pools.kv_events]\nport=5557\nreplay_port=5567\ndata_parallel_size=2\ntokenizer='{}'\n",
        dir.display()
    ))
    .unwrap();
    let k = c.pools[0].kv_events.as_ref().unwrap();
    assert_eq!(
        (k.port, k.replay_port, k.data_parallel_size, k.max_blocks),
        (Some(5557), Some(5567), 2, 1 << 20)
    );
    assert_eq!(k.tokenizer.as_deref(), Some(dir.as_path()));
    assert_eq!(c.pools[0].backends[1].kv_events_port, Some(6000));
    for (tail, says) in [
        (
            "[pools.affinity]\nby='kv_events'\n",
            "give the pool a [pools.kv_events] table",
        ),
        (
            "[pools.affinity]\nby='kv_events'\n[pools.kv_events]\nport=5557\n",
            "the model's `tokenizer` directory",
        ),
        ("[pools.kv_events]\nport=0\n", "publisher port"),
        (
            "[pools.kv_events]\nport=5557\nreplay_port=5558\ndata_parallel_size=2\n",
            "overlaps",
        ),
        (
            "[pools.kv_events]\nport=65535\ndata_parallel_size=2\n",
            "must be a port",
        ),
        (
            "[pools.kv_events]\nport=5557\nmax_blocks=10\n",
            "between 1024",
        ),
        (
            "[pools.kv_events]\nport=5557\ntokenizer='/nonexistent'\n",
            "holds no tokenizer.json",
        ),
        (
            "[pools.kv_events]\nport=5557\nchat_template='/x.jinja'\n",
            "goes with `tokenizer`",
        ),
        (
            "[pools.kv_events]\nport=5557\nendpoint='tcp://x'\n",
            "endpoint",
        ),
        (
            "[pools.kv_events]\ntopic='kv'\n",
            "pools[0].backends[0]: has no KV event publisher port",
        ),
        ("[pools.kv_events]\nreplay_port=5558\n", "goes with `port`"),
    ] {
        let e = parse(&format!("{pool}{tail}")).unwrap_err().to_string();
        assert!(e.contains(says), "{tail}: {e}");
    }
    // Backends that publish no events, or name their own port, need no pool port.
    let c = parse(
        "[[pools]]\nmodel='m'\nbackends=[{url='http://a:8000', kv_events=false}, {url='http://b:8000', kv_events_port=6000}]\n[pools.kv_events]\ntopic='kv'\n",
    )
    .unwrap();
    let b = &c.pools[0].backends;
    assert_eq!(c.pools[0].kv_events.as_ref().unwrap().port, None);
    assert_eq!((b[0].kv_events, b[1].kv_events), (false, true));
    let e = parse(
        "[[pools]]\nmodel='m'\nbackends=[{url='http://a:8000', kv_events=false, kv_events_port=6000}]\n[pools.kv_events]\nport=5557\n",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("kv_events = false"), "{e}");
}

#[test]
fn fallbacks_name_other_pools_once_and_their_mistakes_are_named() {
    let two = |a: &str| {
        format!(
            "[[pools]]\nmodel='big'\nbackends=['http://a:1']\n{a}\n[[pools]]\nmodel='small'\naliases=['s']\nbackends=['http://b:1']\n"
        )
    };
    let c = parse(&two(
        "fallbacks=['s']\ncontext_window_fallbacks=['small']\nfallback_environments=['prod']\nmax_model_len=4096",
    ))
    .unwrap();
    let f = &c.pools[0].fallback;
    assert_eq!(f.on_failure, ["s"]);
    assert_eq!(f.context_window, ["small"]);
    assert_eq!(f.environments, Some(vec![Environment::Prod]));
    assert_eq!(f.max_model_len, Some(4096));
    assert!(c.pools[1].fallback.is_empty());
    for (extra, field, says) in [
        (
            "fallbacks=['big']",
            "pools[0].fallbacks[0]",
            "this pool itself",
        ),
        (
            "fallbacks=['tiny']",
            "pools[0].fallbacks[0]",
            "no pool serves `tiny`",
        ),
        (
            "fallbacks=['small','small']",
            "pools[0].fallbacks[1]",
            "named twice",
        ),
        (
            "context_window_fallbacks=['nope']",
            "pools[0].context_window_fallbacks[0]",
            "no pool serves",
        ),
        (
            "fallback_environments=[]",
            "pools[0].fallback_environments",
            "at least one",
        ),
        (
            "fallback_environments=['prod']",
            "pools[0].fallback_environments",
            "no `fallbacks`",
        ),
        ("max_model_len=0", "pools[0].max_model_len", "> 0"),
    ] {
        let e = parse(&two(extra)).unwrap_err();
        assert_eq!(e.field, field, "{extra}");
        assert!(e.message.contains(says), "{extra}: {}", e.message);
    }
}
