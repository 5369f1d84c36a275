//! The map holds. Between crates: the sim depends on no other crate of the workspace, the bench
//! and the gateway only on the protocol crate, and the gateway's build has none of the tools'
//! dependencies (read from `cargo metadata` and `cargo tree`). Inside the gateway crate: every
//! top-level module has a layer, a module uses only its own layer or lower ones, and the modules
//! do not import each other in a circle, read from the sources themselves (every
//! `crate::<module>` path), so a new `use crate::proxy` in the store, auth, limits or telemetry
//! fails here. docs/architecture.md draws the same map. And no source file grows past 700
//! lines before its tests.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The layers of docs/architecture.md, inside the gateway crate. The tools (the sim, the bench)
/// are crates of their own: the compiler keeps them off the request path, and
/// `the_crates_depend_on_each_other_as_drawn` below holds the crate map.
const LAYERS: &[(&str, u8)] = &[
    ("clock", 0),
    ("rx_time", 0),
    ("secret", 0),
    ("config", 1),
    ("key", 1),
    ("store", 1),
    ("auth", 2),
    ("limits", 2),
    ("pool", 2),
    ("queue", 2),
    ("route", 2),
    ("telemetry", 2),
    ("proxy", 3),
    ("admin", 4),
    ("server", 4),
];

/// Top-level module → the other top-level modules its files name as `crate::<module>`.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/gateway/src");
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(&src).unwrap();
            let first = rel
                .components()
                .next()
                .unwrap()
                .as_os_str()
                .to_string_lossy();
            let module = first.trim_end_matches(".rs").to_owned();
            if module == "lib" {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let used = graph.entry(module.clone()).or_default();
            for (at, _) in text.match_indices("crate::") {
                let name: String = text[at + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() && name != module {
                    used.insert(name);
                }
            }
        }
    }
    graph
}

fn layer_of(module: &str) -> Option<u8> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|(_, l)| *l)
}

#[test]
fn every_module_has_a_layer_and_imports_only_downwards() {
    let graph = imports();
    let mut wrong = Vec::new();
    for (module, used) in &graph {
        let Some(own) = layer_of(module) else {
            wrong.push(format!(
                "{module} has no layer: add it to LAYERS here and to docs/architecture.md"
            ));
            continue;
        };
        for u in used {
            match layer_of(u) {
                Some(l) if l <= own => {}
                Some(l) => wrong.push(format!(
                    "{module} (layer {own}) uses {u} (layer {l}): a lower layer must not import a higher one"
                )),
                None => wrong.push(format!("{module} (layer {own}) uses {u}")),
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn the_modules_import_each_other_in_no_circle() {
    let graph = imports();
    // Depth-first search for a back edge; the path found names the circle.
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut circle = path[at..].to_vec();
            circle.push(m.to_owned());
            return Some(circle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_owned());
        for next in graph.get(m).into_iter().flatten() {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    for m in graph.keys() {
        let mut path = Vec::new();
        if let Some(circle) = visit(m, &graph, &mut path, &mut done) {
            panic!("import circle: {}", circle.join(" -> "));
        }
    }
}

#[test]
fn the_lower_layers_never_name_the_proxy_or_the_server() {
    let graph = imports();
    for lower in ["store", "auth", "limits", "telemetry", "config", "key"] {
        let used = graph.get(lower).cloned().unwrap_or_default();
        for upper in ["proxy", "server"] {
            assert!(
                !used.contains(upper),
                "{lower} imports crate::{upper}: the lower layers must not know the request path's top"
            );
        }
    }
}

/// `cargo` with the workspace's manifest, as the test's own cargo runs it.
fn cargo(args: &[&str]) -> String {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let out = std::process::Command::new(env!("CARGO"))
        .args(args)
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--offline")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_crates_depend_on_each_other_as_drawn() {
    let meta: serde_json::Value =
        serde_json::from_str(&cargo(&["metadata", "--format-version", "1", "--no-deps"])).unwrap();
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for p in meta["packages"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap().to_owned();
        let inner = p["dependencies"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["kind"].is_null())
            .filter_map(|d| d["name"].as_str())
            .filter(|d| d.starts_with("fleetgate"))
            .map(str::to_owned)
            .collect();
        deps.insert(name, inner);
    }
    let want = |names: &[&str]| {
        names
            .iter()
            .map(|n| (*n).to_owned())
            .collect::<BTreeSet<_>>()
    };
    let expected: BTreeMap<String, BTreeSet<String>> = [
        ("fleetgate-protocol", want(&[])),
        ("fleetgate-sim", want(&[])),
        ("fleetgate-bench", want(&["fleetgate-protocol"])),
        ("fleetgate-gateway", want(&["fleetgate-protocol"])),
        (
            "fleetgate",
            want(&[
                "fleetgate-bench",
                "fleetgate-gateway",
                "fleetgate-protocol",
                "fleetgate-sim",
            ]),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    assert_eq!(
        deps, expected,
        "the workspace's crates and their dependencies"
    );
}

#[test]
fn the_gateway_builds_without_the_tools_dependencies() {
    let tree = cargo(&[
        "tree",
        "-p",
        "fleetgate-gateway",
        "-e",
        "normal",
        "--prefix",
        "none",
    ]);
    let names: BTreeSet<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(names.contains("hyper"), "not a dependency tree: {tree}");
    // `tokenizers` is the gateway's own since it cuts prompts into the engines' tokens
    // (`pool::PromptTokens`, for the KV events' blocks).
    for tool_only in ["rand_distr", "fleetgate-sim", "fleetgate-bench"] {
        assert!(
            !names.contains(tool_only),
            "the gateway crate depends on {tool_only}, which only the tools use"
        );
    }
}

/// Small files, one concern each: no source file of the workspace holds more than 700 lines
/// before its `#[cfg(test)]` part (the integration tests under `tests/` aside).
#[test]
fn no_source_file_is_over_700_lines_tests_aside() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut stack = vec![root.join("src"), root.join("crates"), root.join("benches")];
    let mut long = Vec::new();
    let mut seen = 0;
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                // A directory named `tests` holds unit tests split out of their module.
                if path.file_name().is_some_and(|n| n != "tests") {
                    stack.push(path);
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs")
                || path.file_name().is_some_and(|n| n == "tests.rs")
            {
                continue;
            }
            seen += 1;
            let text = std::fs::read_to_string(&path).unwrap();
            let lines = text
                .lines()
                .take_while(|l| l.trim() != "#[cfg(test)]")
                .count();
            if lines > 700 {
                long.push(format!("{} ({lines} lines)", path.display()));
            }
        }
    }
    assert!(seen > 100, "read only {seen} source files");
    assert!(long.is_empty(), "split these files: {long:?}");
}
