//! The layering holds: no crate links what its layer must not (read from
//! `cargo metadata`), and no two modules of a crate import each other,
//! directly or around a loop (read from the sources).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// This machine's target triple, from `rustc -vV`.
fn host_triple() -> &'static str {
    static T: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let out = std::process::Command::new("rustc").arg("-vV").output().unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("host: "))
            .unwrap()
            .to_string()
    })
}

struct Metadata {
    /// Packages by name (every version of a name merged).
    packages: BTreeMap<String, Vec<Value>>,
    members: BTreeSet<String>,
}

fn metadata() -> Metadata {
    let out = std::process::Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .current_dir(workspace())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ws: Value = serde_json::from_slice(&out.stdout).unwrap();
    let members: BTreeSet<String> = ws["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    // With dependencies: every package the lock file can reach.
    let out = std::process::Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--filter-platform", host_triple()])
        .current_dir(workspace())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let all: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut packages: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for p in all["packages"].as_array().unwrap() {
        packages
            .entry(p["name"].as_str().unwrap().to_string())
            .or_default()
            .push(p.clone());
    }
    Metadata { packages, members }
}

impl Metadata {
    /// Every package `root` links (normal dependencies, transitively) when
    /// built alone with its default features. Weft's own crates are walked
    /// with their features exactly (an optional dependency counts only when
    /// a feature turns it on); other crates conservatively, with every
    /// optional dependency counted.
    fn links(&self, root: &str) -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo: Vec<(String, BTreeSet<String>)> = vec![(root.to_string(), ["default".to_string()].into())];
        let mut walked: BTreeSet<(String, BTreeSet<String>)> = BTreeSet::new();
        while let Some((name, features)) = todo.pop() {
            if !walked.insert((name.clone(), features.clone())) {
                continue;
            }
            seen.insert(name.clone());
            for p in self.packages.get(&name).into_iter().flatten() {
                let on = expand(p, &features);
                for d in p["dependencies"].as_array().unwrap() {
                    if !d["kind"].is_null() {
                        continue; // dev and build dependencies are not linked
                    }
                    let dep = d["name"].as_str().unwrap();
                    let key = d["rename"].as_str().unwrap_or(dep);
                    let optional = d["optional"].as_bool().unwrap();
                    if optional && !on.contains(&format!("dep:{key}")) {
                        continue;
                    }
                    let mut f: BTreeSet<String> = d["features"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_str().unwrap().to_string())
                        .collect();
                    if d["uses_default_features"].as_bool().unwrap() {
                        f.insert("default".into());
                    }
                    for x in &on {
                        if let Some(feat) = x.strip_prefix(&format!("{key}/")) {
                            f.insert(feat.to_string());
                        }
                    }
                    todo.push((dep.to_string(), f));
                }
            }
        }
        seen.remove(root);
        seen
    }
}

/// The features `asked` turns on in package `p`, transitively, as
/// `name`, `dep:x` and `x/feature` entries.
fn expand(p: &Value, asked: &BTreeSet<String>) -> BTreeSet<String> {
    let table = p["features"].as_object().unwrap();
    let mut on = BTreeSet::new();
    let mut todo: Vec<String> = asked.iter().cloned().collect();
    while let Some(f) = todo.pop() {
        if !on.insert(f.clone()) {
            continue;
        }
        if let Some(list) = table.get(&f).and_then(Value::as_array) {
            todo.extend(list.iter().map(|x| x.as_str().unwrap().to_string()));
        }
        if let Some((dep, _)) = f.split_once('/') {
            on.insert(format!("dep:{}", dep.trim_end_matches('?')));
        }
    }
    on
}

#[test]
fn weftctl_links_only_the_api_and_the_shared_crates() {
    let m = metadata();
    let links = m.links("weftctl");
    let weft: Vec<&String> = links.iter().filter(|n| n.starts_with("weft")).collect();
    assert_eq!(
        weft,
        ["weft-common", "weft-proto", "weft-types"],
        "weftctl's weft dependencies"
    );
    for banned in [
        "etcd-client",
        "redb",
        "rtnetlink",
        "nftables",
        "defguard_boringtun",
        "boringtun",
        "defguard_wireguard_rs",
    ] {
        assert!(!links.contains(banned), "weftctl links {banned}");
    }
    // The walk itself sees these crates where they are: it is not blind.
    let controller = m.links("weft-controller");
    assert!(controller.contains("etcd-client") && controller.contains("redb"));
    let agent = m.links("weft-agent");
    assert!(agent.contains("rtnetlink") && agent.contains("defguard_boringtun"));
    assert!(agent.contains("defguard_wireguard_rs"));
    assert!(
        !controller.contains("rtnetlink") && !controller.contains("defguard_wireguard_rs"),
        "the controller links the data plane"
    );
}

#[test]
fn the_controller_core_links_no_tonic_and_no_store() {
    let links = metadata().links("weft-core");
    for banned in [
        "tonic",
        "etcd-client",
        "redb",
        "tokio",
        "weft-controller",
        "hyper",
        "rtnetlink",
        "nftables",
        // TLS (a peer's CA certificate is parsed by the controller).
        "rustls",
        // The controller's configuration file is the controller's.
        "toml",
    ] {
        assert!(!links.contains(banned), "weft-core links {banned}: {links:?}");
    }
    assert!(links.contains("prost"), "the walk reaches the API's messages");
}

#[test]
fn the_typed_values_are_a_leaf() {
    let links = metadata().links("weft-types");
    let weft: Vec<&String> = links.iter().filter(|n| n.starts_with("weft")).collect();
    assert!(weft.is_empty(), "weft-types links weft crates: {weft:?}");
    for banned in ["tokio", "tonic", "prost", "rustls", "rtnetlink", "serde_json"] {
        assert!(!links.contains(banned), "weft-types links {banned}: {links:?}");
    }
    assert!(
        links.contains("ipnet") && links.contains("base64"),
        "the walk reaches its parsers: {links:?}"
    );
    // Every layer that parses what crosses a border uses it.
    let m = metadata();
    for user in ["weft-core", "weft-controller", "weft-dataplane", "weft-agent"] {
        assert!(m.links(user).contains("weft-types"), "{user} does not use weft-types");
    }
}

/// The top-level modules of a crate's `src` and, for each, the top-level
/// modules it names through `crate::`.
fn module_imports(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    fn files(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                files(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut all = Vec::new();
    files(src, &mut all);
    let module_of = |p: &Path| -> String {
        let rel = p.strip_prefix(src).unwrap();
        let first = rel.components().next().unwrap().as_os_str().to_str().unwrap();
        first.trim_end_matches(".rs").to_string()
    };
    let modules: BTreeSet<String> = all.iter().map(|p| module_of(p)).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for p in &all {
        let from = module_of(p);
        if ["lib", "main", "bin"].contains(&from.as_str()) {
            continue; // the crate root wires modules together
        }
        let text = std::fs::read_to_string(p).unwrap();
        for (i, _) in text.match_indices("crate::") {
            let rest = &text[i + "crate::".len()..];
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            // `crate::{a, b}` names several.
            let names: Vec<String> = if rest.starts_with('{') {
                let inner = &rest[1..rest.find('}').unwrap_or(1)];
                inner
                    .split(',')
                    .map(|s| s.trim().split("::").next().unwrap_or("").to_string())
                    .collect()
            } else {
                vec![name]
            };
            for n in names {
                if n != from && modules.contains(&n) {
                    graph.entry(from.clone()).or_default().insert(n);
                }
            }
        }
        graph.entry(from).or_default();
    }
    graph
}

/// A cycle in `g`, if there is one.
fn cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|x| x == n) {
            let mut c = path[at..].to_vec();
            c.push(n.to_string());
            return Some(c);
        }
        if done.contains(n) {
            return None;
        }
        path.push(n.to_string());
        for m in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, g, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    g.keys().find_map(|n| visit(n, g, &mut Vec::new(), &mut done))
}

#[test]
fn no_module_imports_from_a_module_that_imports_it_back() {
    let m = metadata();
    let mut checked = 0;
    for name in &m.members {
        let p = &m.packages[name][0];
        let dir = Path::new(p["manifest_path"].as_str().unwrap()).parent().unwrap();
        let src = dir.join("src");
        if !src.exists() {
            continue;
        }
        let g = module_imports(&src);
        assert!(cycle(&g).is_none(), "{name}: import cycle {:?}", cycle(&g).unwrap());
        checked += 1;
    }
    assert!(checked >= 8, "looked at {checked} crates");
    // The check sees a cycle where there is one.
    let g: BTreeMap<String, BTreeSet<String>> = [
        ("a".to_string(), ["b".to_string()].into()),
        ("b".to_string(), ["a".to_string()].into()),
    ]
    .into();
    assert_eq!(cycle(&g).unwrap(), ["a", "b", "a"]);
}
