//! `[pools.priority]` across replicas: prod goes first at a one-slot backend whose slot and
//! queue other replicas' gray requests hold.

use super::*;

/// Prod first across replicas: each replica may put `max_in_flight_per_backend` (the backend's
/// one slot here) on the backend, so the backend's own queue, ordered by `[pools.priority]`,
/// decides who goes next whichever replica sent what. A gray request holds the slot (through
/// replica 0), two gray requests wait at the backend (sent by replicas 1 and 2), a third waits in
/// replica 0's own queue, and then a prod request reaches replica 0, whose one place is taken:
/// it passes the gray request waiting there and the capacity, and the backend admits it before
/// every gray request that waited before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prod_goes_first_at_the_backend_whichever_replica_holds_the_seats() {
    use std::sync::atomic::Ordering::SeqCst;
    let Some(db) = pg_database("multi_replica_priority").await else {
        return;
    };
    let Some(redis) = redis_url("multi_replica_priority").await else {
        return;
    };
    let sim = sim(|a| {
        a.max_num_seqs = 1;
        a.decode_step_ms = 5.0;
        a.decode_ms_per_seq = 0.0;
        a.scheduling_policy = fleetgate_sim::SchedulingPolicy::Priority;
    })
    .await;
    let dir = temp_dir("multi-replica-priority");
    let pools = format!(
        r#"[[pools]]
model = "qwen32b"
backends = ["{sim}"]
max_in_flight_per_backend = 1

[pools.priority]
"#,
        sim = sim.url()
    );
    let replicas = start_replicas(&db.url, &redis, &dir, &pools).await;
    let gray = issue_key_on(&replicas[0], "gray", "gray").await;
    let prod = issue_key_on(&replicas[0], "prod", "prod").await;
    let stats = sim.stats().clone();
    let done = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    // (name, replica, key, tokens, backend running + waiting once it is sent)
    for (name, replica, key, tokens, at_backend) in [
        ("gray-holder", 0, &gray, 300, Some(0)),
        ("gray-1", 1, &gray, 10, Some(1)),
        ("gray-2", 2, &gray, 10, Some(2)),
        ("gray-3", 0, &gray, 10, None),
        ("prod", 0, &prod, 10, Some(3)),
    ] {
        let url = replicas[replica].url("/v1/chat/completions");
        let auth = format!("Bearer {key}");
        let done = done.clone();
        let body = serde_json::json!({"model": "qwen32b", "max_tokens": tokens, "stream": true,
                                      "messages": [{"role": "user", "content": "hi"}]});
        tasks.push(tokio::spawn(async move {
            let m = post(&url, &[("authorization", &auth)], body.to_string()).await;
            assert_eq!(m.status, 200, "{name}: {:?}", m.body);
            done.lock().unwrap().push(name);
        }));
        match at_backend {
            Some(waiting) => {
                let engine = stats.clone();
                assert!(
                    eventually(Duration::from_secs(10), || {
                        engine.running.load(SeqCst) == 1 && engine.waiting.load(SeqCst) == waiting
                    })
                    .await,
                    "{name} reached the backend"
                );
            }
            None => {
                // It waits in replica 0's queue: the backend sees nothing new.
                assert!(
                    eventually(Duration::from_secs(10), || {
                        let text = std::process::Command::new("curl")
                            .args(["-s", "-H"])
                            .arg(format!("authorization: Bearer {}", token(Role::Admin)))
                            .arg(format!(
                                "http://127.0.0.1:{}/metrics",
                                replicas[0].admin_port
                            ))
                            .output()
                            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                            .unwrap_or_default();
                        text.lines()
                            .any(|l| l.starts_with("fleetgate_queue_depth") && l.ends_with(" 1"))
                    })
                    .await,
                    "{name} waits in replica 0's queue"
                );
                assert_eq!(
                    stats.waiting.load(SeqCst),
                    2,
                    "{name} is not at the backend"
                );
            }
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        *done.lock().unwrap(),
        ["gray-holder", "prod", "gray-1", "gray-2", "gray-3"],
        "the backend admitted prod before the gray requests that waited before it, wherever they waited"
    );
    drop(replicas);
    let _ = std::fs::remove_dir_all(&dir);
}
