//! The layering holds: no crate links what its layer must not (read from
//! `cargo metadata`), and no two modules of a crate import each other,
//! directly or around a loop, at any depth (read from the sources).

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

#[test]
fn the_userspace_device_is_plain_threads_and_no_production_build_links_boringtuns_device() {
    let m = metadata();
    let links = m.links("weft-wg-device");
    let weft: Vec<&String> = links.iter().filter(|n| n.starts_with("weft")).collect();
    assert!(weft.is_empty(), "weft-wg-device links weft crates: {weft:?}");
    for banned in ["tokio", "rtnetlink", "tonic", "defguard_wireguard_rs"] {
        assert!(!links.contains(banned), "weft-wg-device links {banned}");
    }
    assert!(m.links("weft-dataplane").contains("weft-wg-device"));
    // boringtun's own device (the throughput bench's baseline) is the
    // bench's alone: `cargo tree` resolves features as a build of that
    // package alone would.
    let tree = |package: &str| {
        let out = std::process::Command::new(env!("CARGO"))
            .args(["tree", "--offline", "-e", "features", "-p", package])
            .current_dir(workspace())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let device = "defguard_boringtun feature \"device\"";
    for package in ["weft-gateway-agent", "weft-node-agent", "weft-controller", "weftctl"] {
        assert!(!tree(package).contains(device), "{package} links boringtun's device");
    }
    assert!(
        tree("weft-tests").contains(device),
        "the walk sees the bench's baseline"
    );
}

/// A module's path from its crate's root (`["render", "ipv6"]`).
type ModPath = Vec<String>;

/// `text` with comments, string and character literals blanked out (so a
/// doc comment that names `crate::x` is no import), and `#[cfg(test)]`
/// modules written inline dropped (test code may use anything).
fn code_of(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == 'r'
            && (next == Some('"') || next == Some('#'))
            && !b[..i].last().is_some_and(|p| p.is_alphanumeric() || *p == '_')
        {
            // A raw string: r"…", r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == '"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == '"' {
            i += 1;
            while i < b.len() && b[i] != '"' {
                i += if b[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == '\'' {
            // A character literal ('x', '\n', '\u{1F600}'), or a lifetime.
            if next == Some('\\') {
                let mut j = i + 2;
                while j < b.len() && b[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
                out.push_str("' '");
            } else if b.get(i + 2) == Some(&'\'') {
                i += 3;
                out.push_str("' '");
            } else {
                out.push(c);
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    // Drop `#[cfg(test)] mod x { … }`.
    while let Some(at) = out.find("#[cfg(test)]") {
        let rest = &out[at + "#[cfg(test)]".len()..];
        let head: String = rest
            .trim_start()
            .chars()
            .take_while(|c| *c != '{' && *c != ';')
            .collect();
        let words: Vec<&str> = head.split_whitespace().collect();
        let inline_mod = words.contains(&"mod")
            && rest.trim_start().len() > head.len()
            && rest.trim_start()[head.len()..].starts_with('{');
        if !inline_mod {
            // Some other test-only item: keep it, look further.
            let (before, after) = out.split_at(at);
            out = format!("{before}#[cfg_test_seen]{}", &after["#[cfg(test)]".len()..]);
            continue;
        }
        let open = at + "#[cfg(test)]".len() + (rest.len() - rest.trim_start().len()) + head.len();
        let mut depth = 0;
        let mut end = out.len();
        for (k, ch) in out[open..].char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.replace_range(at..end, "");
    }
    out
}

/// The paths written in `code` that start with `crate`, `super` or `self`,
/// or with one of `bare` (the sibling modules a file's `use super::*`
/// brings in), each as its segments; a `{…}` group gives one path per item.
fn paths_in(code: &str, bare: &BTreeSet<String>) -> Vec<Vec<String>> {
    let b: Vec<char> = code.chars().collect();
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut out = Vec::new();
    // Reads `a::b::{…}` from `i`, with `prefix` before it.
    fn read(b: &[char], mut i: usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
        let ident = |c: char| c.is_alphanumeric() || c == '_';
        let mut segs = prefix;
        loop {
            while i < b.len() && b[i].is_whitespace() {
                i += 1;
            }
            if b.get(i) == Some(&'{') {
                // One path per item of the group, at this depth.
                let mut depth = 0;
                let mut item_start = i + 1;
                let mut j = i;
                while j < b.len() {
                    match b[j] {
                        '{' => depth += 1,
                        '}' | ',' if depth == 1 => {
                            read(b, item_start, segs.clone(), out);
                            item_start = j + 1;
                            if b[j] == '}' {
                                return;
                            }
                        }
                        '}' => depth -= 1,
                        _ => {}
                    }
                    j += 1;
                }
                return;
            }
            let s = i;
            while i < b.len() && ident(b[i]) {
                i += 1;
            }
            if s == i {
                break;
            }
            segs.push(b[s..i].iter().collect());
            if b.get(i) == Some(&':') && b.get(i + 1) == Some(&':') {
                i += 2;
            } else {
                break;
            }
        }
        if !segs.is_empty() {
            out.push(segs);
        }
    }
    let mut i = 0;
    while i < b.len() {
        if ident(b[i]) && (i == 0 || (!ident(b[i - 1]) && b[i - 1] != ':')) {
            let s = i;
            while i < b.len() && ident(b[i]) {
                i += 1;
            }
            let word: String = b[s..i].iter().collect();
            let starts = ["crate", "super", "self"].contains(&word.as_str()) || bare.contains(&word);
            if starts && b.get(i) == Some(&':') && b.get(i + 1) == Some(&':') {
                let before = out.len();
                read(&b, s, Vec::new(), &mut out);
                // A path with nothing after the first `::` names nothing.
                if out.len() > before && out.last().unwrap().len() < 2 {
                    out.pop();
                }
            }
        } else {
            i += 1;
        }
    }
    out
}

/// A crate's modules (one per file under `src`, by path from the crate
/// root; test files, under `tests` modules, and `src/bin` left out) and,
/// for each, the modules its production code names.
fn module_imports(src: &Path) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
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
    let module_of = |p: &Path| -> ModPath {
        let rel = p.strip_prefix(src).unwrap().with_extension("");
        let mut segs: ModPath = rel
            .components()
            .map(|c| c.as_os_str().to_str().unwrap().to_string())
            .collect();
        if segs.last().is_some_and(|l| l == "mod") || segs == ["lib"] || segs == ["main"] {
            segs.pop();
        }
        segs
    };
    let files: Vec<(ModPath, &PathBuf)> = all
        .iter()
        .map(|p| (module_of(p), p))
        .filter(|(m, _)| m.first().is_none_or(|f| f != "bin") && m.iter().all(|seg| seg != "tests"))
        .collect();
    let modules: BTreeSet<ModPath> = files.iter().map(|(m, _)| m.clone()).collect();
    let codes: Vec<(ModPath, String)> = files
        .iter()
        .map(|(m, p)| (m.clone(), code_of(&std::fs::read_to_string(p).unwrap())))
        .collect();
    let children = |m: &ModPath| -> BTreeSet<String> {
        modules
            .iter()
            .filter(|c| c.len() == m.len() + 1 && c[..m.len()] == m[..])
            .map(|c| c.last().unwrap().clone())
            .collect()
    };
    // What each module brings in from its children by name (`pub use
    // b::X;`, `use self::b::{X, Y};`): a path that names `X` through the
    // module names `b`.
    let mut exports: BTreeMap<ModPath, BTreeMap<String, ModPath>> = BTreeMap::new();
    for (m, code) in &codes {
        let kids = children(m);
        for stmt in code.split(';') {
            let t = stmt.trim_start();
            let t = ["pub(crate) ", "pub(super) ", "pub "]
                .iter()
                .find_map(|v| t.strip_prefix(v))
                .unwrap_or(t);
            let Some(body) = t.strip_prefix("use ") else { continue };
            let body = body.trim_start();
            let body = body.strip_prefix("self::").unwrap_or(body);
            for path in paths_in(body, &kids) {
                let mut target = m.clone();
                let mut found = None;
                for seg in &path[..path.len() - 1] {
                    target.push(seg.clone());
                    if !modules.contains(&target) {
                        break;
                    }
                    found = Some(target.clone());
                }
                if let Some(child) = found {
                    exports
                        .entry(m.clone())
                        .or_default()
                        .insert(path.last().unwrap().clone(), child);
                }
            }
        }
    }
    let mut graph: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (from, code) in &codes {
        let parent: ModPath = from[..from.len().saturating_sub(1)].to_vec();
        // `use super::*` brings the parent's child modules in by bare name.
        let bare: BTreeSet<String> = if !from.is_empty() && code.contains("use super::*") {
            modules
                .iter()
                .filter(|m| m.len() == from.len() && m[..m.len() - 1] == parent[..] && *m != from)
                .map(|m| m.last().unwrap().clone())
                .collect()
        } else {
            BTreeSet::new()
        };
        for path in paths_in(code, &bare) {
            let mut at: ModPath = from.clone();
            let mut rest = &path[..];
            match rest[0].as_str() {
                "crate" => {
                    at.clear();
                    rest = &rest[1..];
                }
                "self" => rest = &rest[1..],
                "super" => {
                    while rest.first().is_some_and(|s| s == "super") {
                        at.pop();
                        rest = &rest[1..];
                    }
                }
                _ => at = parent.clone(), // a sibling by bare name
            }
            // The longest module the path names, and past it a name that
            // module brings in from one of its children: that child.
            let mut target = at.clone();
            let mut found = None;
            let mut used = 0;
            for (i, seg) in rest.iter().enumerate() {
                target.push(seg.clone());
                if !modules.contains(&target) {
                    break;
                }
                found = Some(target.clone());
                used = i + 1;
            }
            let base = found.clone().unwrap_or_else(|| at.clone());
            let via = rest
                .get(used)
                .and_then(|name| exports.get(&base).and_then(|e| e.get(name)))
                .cloned();
            if let Some(to) = via.or(found) {
                graph.entry(from.clone()).or_default().insert(to);
            }
        }
        graph.entry(from.clone()).or_default();
    }
    graph
}

/// The imports of `g` lifted to where they can form a loop: an import from
/// `a::b::c` of `a::d::e` is one of `a::b` by `a::d`, siblings under their
/// nearest common module. A module's use of its own ancestors or
/// descendants is no edge (a parent holds its children). Nodes are
/// `::`-joined paths; the crate's top-level modules are siblings too.
fn sibling_edges(g: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, tos) in g {
        for to in tos {
            let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
            if common == from.len() || common == to.len() {
                continue;
            }
            out.entry(from[..=common].join("::"))
                .or_default()
                .insert(to[..=common].join("::"));
        }
    }
    out
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
        let g = sibling_edges(&module_imports(&src));
        assert!(cycle(&g).is_none(), "{name}: import cycle {:?}", cycle(&g).unwrap());
        checked += 1;
    }
    assert!(checked >= 8, "looked at {checked} crates");
    // The walk is not blind: it sees the render module's parts use their
    // shared ids, at the level below the crate's top.
    let core = module_imports(&workspace().join("core/src"));
    let ids = vec!["render".to_string(), "ids".to_string()];
    assert!(
        core[&vec!["render".to_string(), "ipv6".to_string()]].contains(&ids),
        "render::ipv6 -> render::ids not seen: {core:?}"
    );
}

/// Writes `files` (path under `src`, text) into a new crate folder; its `src`.
fn planted(name: &str, files: &[(&str, &str)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("weft-layers-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for (path, text) in files {
        let p = dir.join("src").join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    dir.join("src")
}

#[test]
fn a_cycle_between_modules_below_the_crates_top_is_found() {
    // Two children of `render` import each other, each in a different
    // way: through `super::`, and through `crate::` in a `use` group.
    let src = planted(
        "cycle",
        &[
            ("lib.rs", "pub mod render;\n"),
            ("render.rs", "mod a;\nmod b;\npub use a::f;\n"),
            ("render/a.rs", "use super::b::Ids;\npub fn f(_: Ids) {}\n"),
            (
                "render/b.rs",
                "use crate::{render::a::f, x};\npub struct Ids;\nfn g() { f(Ids) }\n",
            ),
        ],
    );
    let g = sibling_edges(&module_imports(&src));
    std::fs::remove_dir_all(src.parent().unwrap()).unwrap();
    assert_eq!(cycle(&g).unwrap(), ["render::a", "render::b", "render::a"], "{g:?}");
    // Through a glob import of the parent, by a bare sibling name.
    let src = planted(
        "glob",
        &[
            ("lib.rs", "mod render;\n"),
            ("render.rs", "mod a;\nmod b;\n"),
            ("render/a.rs", "use super::*;\nfn f() { b::g() }\n"),
            ("render/b.rs", "pub fn g() { super::a::f() }\n"),
        ],
    );
    let g = sibling_edges(&module_imports(&src));
    std::fs::remove_dir_all(src.parent().unwrap()).unwrap();
    assert!(cycle(&g).is_some(), "{g:?}");
    // Through a name the parent brings in from the other child.
    let src = planted(
        "reexport",
        &[
            ("lib.rs", "mod render;\n"),
            ("render.rs", "mod a;\nmod b;\npub use b::Ids;\n"),
            ("render/a.rs", "use super::Ids;\npub fn f(_: Ids) {}\n"),
            ("render/b.rs", "pub struct Ids;\nfn g() { super::a::f(Ids) }\n"),
        ],
    );
    let g = sibling_edges(&module_imports(&src));
    std::fs::remove_dir_all(src.parent().unwrap()).unwrap();
    assert_eq!(cycle(&g).unwrap(), ["render::a", "render::b", "render::a"], "{g:?}");
    // None of these is a cycle: a parent and its child using each other, a
    // mention in a comment or a string, and test code.
    let src = planted(
        "none",
        &[
            ("lib.rs", "mod render;\n"),
            ("render.rs", "mod a;\nmod b;\npub use a::f;\nstruct Ids;\n"),
            (
                "render/a.rs",
                "use super::Ids;\n/// Unlike `super::b::g`, this …\npub fn f() { let _ = \"crate::render::b::g\"; }\n",
            ),
            (
                "render/b.rs",
                "use super::a::f;\npub fn g() { f() }\n#[cfg(test)]\nmod tests {\n    use super::*;\n    fn t() { crate::render::a::f(); let _ = '{'; }\n}\n",
            ),
        ],
    );
    let g = sibling_edges(&module_imports(&src));
    std::fs::remove_dir_all(src.parent().unwrap()).unwrap();
    assert!(cycle(&g).is_none(), "{g:?}");
    assert!(g["render::b"].contains("render::a"), "{g:?}");
    // And the loop finder itself.
    let g: BTreeMap<String, BTreeSet<String>> = [
        ("a".to_string(), ["b".to_string()].into()),
        ("b".to_string(), ["a".to_string()].into()),
    ]
    .into();
    assert_eq!(cycle(&g).unwrap(), ["a", "b", "a"]);
}
