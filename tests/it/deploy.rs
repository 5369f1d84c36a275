//! The deployment files stay true: the Kubernetes manifests validate against the Kubernetes
//! schemas (offline, strict: an unknown field is an error), the kustomization lists them, the
//! ConfigMap's fleetgate.toml is a valid config whose variables the pods provide, the drain
//! timings add up, and the Dockerfile builds with the command and files CI checks.

use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const BIN: &str = env!("CARGO_BIN_EXE_fleetgate");
/// The oldest Kubernetes the manifests promise to work with (the preStop `sleep` action).
const KUBERNETES_VERSION: &str = "1.30.0";

fn k8s_dir() -> PathBuf {
    Path::new(ROOT).join("deploy/kubernetes")
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The YAML files of deploy/kubernetes, kustomization.yaml aside.
fn manifests() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(k8s_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "yaml")
                && p.file_name().is_some_and(|n| n != "kustomization.yaml")
        })
        .collect();
    v.sort();
    v
}

/// Whether the offline validator is installed; a loud skip without it (a failure under CI).
fn validator() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import kubernetes_validate"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        let why = "the Python package kubernetes-validate is not installed (pip install kubernetes-validate)";
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("kubernetes manifests: {why}; .ci/run installs it");
        }
        eprintln!("\n*** SKIPPED kubernetes manifest validation: {why} ***\n");
    }
    ok
}

#[test]
fn kubernetes_manifests_validate_against_the_schemas() {
    if !validator() {
        return;
    }
    let files = manifests();
    assert!(files.len() >= 8, "{files:?}");
    let out = Command::new("python3")
        .args([
            "-m",
            "kubernetes_validate",
            "--strict",
            "--no-warn",
            "-k",
            KUBERNETES_VERSION,
        ])
        .args(&files)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy();
        assert!(
            text.lines()
                .any(|l| l.contains(&*name) && l.contains("passed")),
            "{name} was not validated:\n{text}"
        );
    }
    // The validator does catch a typo (a test that cannot fail proves nothing).
    let dir = crate::common::temp_dir("k8s-typo");
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("deployment.yaml");
    std::fs::write(
        &bad,
        read(&k8s_dir().join("deployment.yaml")).replace("readinessProbe", "readinesProbe"),
    )
    .unwrap();
    let out = Command::new("python3")
        .args([
            "-m",
            "kubernetes_validate",
            "--strict",
            "-k",
            KUBERNETES_VERSION,
        ])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success(), "a misspelt field passed");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_kustomization_lists_every_manifest_but_the_examples() {
    let k = read(&k8s_dir().join("kustomization.yaml"));
    let mut listed = Vec::new();
    let mut in_resources = false;
    for line in k.lines() {
        if line.starts_with("resources:") {
            in_resources = true;
            continue;
        }
        if in_resources {
            match line.trim_start().strip_prefix("- ") {
                Some(f) if line.starts_with("  ") => listed.push(f.trim().to_owned()),
                _ => in_resources = false,
            }
        }
    }
    for f in &listed {
        assert!(
            k8s_dir().join(f).exists(),
            "kustomization lists {f}, which is missing"
        );
    }
    for m in manifests() {
        let name = m.file_name().unwrap().to_string_lossy().into_owned();
        let example = name.contains(".example.") || name == "vllm-headless-service.yaml";
        assert_eq!(
            listed.contains(&name),
            !example,
            "{name}: every manifest is in the kustomization, the examples are not"
        );
    }
}

/// The fleetgate.toml block of the ConfigMap.
fn configmap_toml() -> String {
    let text = read(&k8s_dir().join("configmap.yaml"));
    let start = text.find("fleetgate.toml: |").unwrap();
    text[start..]
        .lines()
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `name: VAR` entries of a manifest's `env:` lists.
fn env_names(manifest: &str) -> Vec<String> {
    manifest
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("- name: "))
        .filter(|n| n.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
        .map(str::to_owned)
        .collect()
}

fn number_after(text: &str, key: &str) -> f64 {
    let at = text
        .find(key)
        .unwrap_or_else(|| panic!("`{key}` not found"));
    text[at + key.len()..]
        .trim_start_matches([' ', ':', '=', '\n'])
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|e| panic!("`{key}`: {e}"))
}

#[test]
fn the_configmap_is_a_valid_config_the_pods_can_fill_in() {
    let toml = configmap_toml();
    let deployment = read(&k8s_dir().join("deployment.yaml"));
    let job = read(&k8s_dir().join("migrate-job.yaml"));
    let (pod_env, job_env) = (env_names(&deployment), env_names(&job));
    // Every ${VAR} without a default is set from the Secret in both the gateway and the Job.
    let mut needed = Vec::new();
    let mut rest = toml.as_str();
    while let Some(at) = rest.find("${") {
        let end = rest[at..].find('}').unwrap();
        let var = &rest[at + 2..at + end];
        if !var.contains(":-") {
            needed.push(var.to_owned());
        }
        rest = &rest[at + end..];
    }
    assert!(!needed.is_empty());
    for v in &needed {
        assert!(pod_env.contains(v), "the Deployment does not set {v}");
        assert!(
            job_env.contains(v),
            "the migrate Job does not set {v} (the config needs it)"
        );
    }
    let c = fleetgate_gateway::config::Config::parse("configmap.yaml", &toml, |name| {
        // The pod sets no OpenTelemetry variable: tracing stays off.
        if name.starts_with("OTEL_") {
            return None;
        }
        Some(match name {
            "FLEETGATE_DATABASE_URL" => "postgres://fleetgate:x@postgres:5432/fleetgate".into(),
            "FLEETGATE_REDIS_URL" => "redis://redis:6379/0".into(),
            "FLEETGATE_ADMIN_JWT_SECRET" => "0123456789abcdef0123456789abcdef".into(),
            _ => "secret".into(),
        })
    })
    .unwrap_or_else(|e| panic!("the ConfigMap's fleetgate.toml: {e}"));
    assert!(!c.migrate_on_start, "the Job migrates");
    assert_eq!(
        c.tracing,
        fleetgate_gateway::config::TracingConfig::default()
    );
    assert!(c.server.watch_config);
    assert!(matches!(
        c.pools[0].backends[0].discover,
        fleetgate_gateway::config::Discover::Dns { .. }
    ));
    // Drain timing: preStop sleep + the gateway's grace fit in the pod's termination grace.
    let pre_stop = number_after(
        &deployment[deployment.find("sleep:").unwrap()..],
        "seconds:",
    );
    let grace = c.server.shutdown_grace.as_secs_f64();
    let termination = number_after(&deployment, "terminationGracePeriodSeconds:");
    assert!(
        termination >= pre_stop + grace + 5.0,
        "terminationGracePeriodSeconds {termination} < preStop {pre_stop} + shutdown_grace {grace} + 5"
    );
    // Redis replicas match the Deployment's replicas (the fallback share when Redis is away).
    let replicas = number_after(&deployment, "replicas:");
    assert_eq!(c.limits.redis.as_ref().unwrap().replicas as f64, replicas);
    // The probes use the gateway's own endpoints.
    assert!(deployment.contains("path: /readyz") && deployment.contains("path: /healthz"));
    // Liveness is asked on the admin port: clients filling the API listener's places cannot
    // get a healthy gateway restarted.
    for probe in ["livenessProbe:", "startupProbe:"] {
        let block = deployment.split(probe).nth(1).unwrap();
        let port = block
            .lines()
            .find_map(|l| l.trim().strip_prefix("port:"))
            .unwrap()
            .trim();
        assert_eq!(port, "admin", "{probe}");
    }
}

#[test]
fn the_dockerfile_builds_what_ci_builds() {
    let docker = read(&Path::new(ROOT).join("deploy/Dockerfile"));
    assert!(
        docker.contains(
            "RUN cargo build --release --locked --bin fleetgate --no-default-features --features jemalloc"
        ),
        "the image's build step: the gateway without the tools, with jemalloc"
    );
    let ci = read(&Path::new(ROOT).join(".ci/run"));
    assert!(
        ci.contains("--locked"),
        "CI checks the lock file as the image build does"
    );
    // The build stage copies what the build reads; check that exactly those files make a valid
    // package with the committed lock file.
    let copied: Vec<&str> = docker
        .lines()
        .filter_map(|l| l.strip_prefix("COPY "))
        .filter(|l| !l.starts_with("--from"))
        .flat_map(|l| {
            let parts: Vec<&str> = l.split_whitespace().collect();
            parts[..parts.len() - 1].to_vec()
        })
        .filter(|p| *p != "config/fleetgate.toml")
        .collect();
    for needed in [
        "Cargo.toml",
        "Cargo.lock",
        ".cargo",
        "src",
        "crates",
        "migrations",
        "benches",
    ] {
        assert!(
            copied.contains(&needed),
            "the Dockerfile does not copy {needed}"
        );
    }
    let dir = crate::common::temp_dir("docker-context");
    std::fs::create_dir_all(&dir).unwrap();
    let status = Command::new("cp")
        .arg("-r")
        .args(copied.iter().map(|p| Path::new(ROOT).join(p)))
        .arg(&dir)
        .status()
        .unwrap();
    assert!(status.success());
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--locked",
            "--offline",
            "--no-deps",
            "--format-version",
            "1",
        ])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the image's build context is not a valid package with its lock file: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
    // The health check's command exists and answers like the endpoint.
    assert!(
        docker.contains(r#""/usr/local/bin/fleetgate", "probe", "http://127.0.0.1:8081/healthz""#)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_exits_0_on_a_healthy_gateway_and_1_otherwise() {
    let sim = crate::common::sim(|a| a.zero_delay = true).await;
    let gw = crate::common::gateway(vec![crate::common::pool("qwen32b", &[sim.url()])]).await;
    let url = format!("http://{}/healthz", gw.server.local_addr);
    let dead = format!("http://{}/healthz", crate::common::closed_port().await);
    let missing = format!("http://{}/nope", gw.server.local_addr);
    let codes = tokio::task::spawn_blocking(move || {
        [url, dead, missing].map(|u| {
            let o = Command::new(BIN).args(["probe", &u]).output().unwrap();
            (
                o.status.code(),
                String::from_utf8_lossy(&o.stderr).into_owned(),
            )
        })
    })
    .await
    .unwrap();
    assert_eq!(codes[0].0, Some(0), "{}", codes[0].1);
    assert_eq!(codes[1].0, Some(1));
    assert_eq!(codes[2].0, Some(1));
    assert!(
        codes[2].1.contains("401") || codes[2].1.contains("404"),
        "{}",
        codes[2].1
    );
}
