//! The deployment files in `deploy/` stay valid: the systemd units pass `systemd-analyze
//! verify` (with `ExecStart` pointing at the built binaries) and keep the settings the binaries
//! rely on; every example layout's TOML and `.env` files load with their role's configuration
//! loader; the Grafana dashboard, the alert rules and the operations guide name only metrics
//! the router exports.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use common::config::{ServiceConfig, load};
use decode_worker::DecodeConfig;
use prefill_worker::PrefillConfig;
use router::{RouterConfig, config::BackendKind};
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// No command-line flags: an empty table.
fn no_flags() -> Value {
    Value::Object(serde_json::Map::new())
}

// ------------------------------------------------------------------------------------------
// systemd units

/// A service unit file, the binary its `ExecStart` runs, and the unit name verified (an
/// instance of a template).
const SERVICES: [(&str, &str, &str); 3] = [
    (
        "pdserve-router.service",
        "pdserve-router",
        "pdserve-router.service",
    ),
    (
        "pdserve-prefill@.service",
        "pdserve-prefill",
        "pdserve-prefill@gpu0.service",
    ),
    (
        "pdserve-decode@.service",
        "pdserve-decode",
        "pdserve-decode@gpu4-5.service",
    ),
];

/// `KEY=VALUE` lines of a unit (comments and section headers skipped).
fn directives(unit: &str) -> Vec<(String, String)> {
    unit.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with(['#', ';', '[']))
        .map(|l| {
            let (key, value) = l
                .split_once('=')
                .unwrap_or_else(|| panic!("not KEY=VALUE: {l}"));
            (key.trim().to_owned(), value.trim().to_owned())
        })
        .collect()
}

fn values<'a>(directives: &'a [(String, String)], key: &str) -> Vec<&'a str> {
    directives
        .iter()
        .filter(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .collect()
}

/// Environment variable names the configuration of `C` reads (`PDSERVE_<KEY>`).
fn setting_vars<C: ServiceConfig>() -> BTreeSet<String> {
    let Value::Object(defaults) = serde_json::to_value(C::default()).unwrap() else {
        panic!("settings are a table");
    };
    defaults
        .keys()
        .map(|key| common::env::setting_var(&[key.as_str()]))
        .collect()
}

fn systemd_analyze() -> PathBuf {
    let found = Command::new("systemd-analyze").arg("--version").output();
    assert!(
        found.as_ref().is_ok_and(|o| o.status.success()),
        "systemd-analyze is not installed ({found:?}): run scripts/setup (it installs the Debian \
         package systemd)"
    );
    PathBuf::from("systemd-analyze")
}

#[test]
fn systemd_units_pass_systemd_analyze_verify() {
    let analyze = systemd_analyze();
    let src = deploy_dir().join("systemd");
    let tmp = tempfile::tempdir().unwrap();
    let mut names = Vec::new();
    for entry in fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        let mut text = read(&path);
        if let Some((_, bin, _)) = SERVICES.iter().find(|(file, _, _)| *file == name) {
            let installed = format!("ExecStart=/usr/local/bin/{bin} ");
            assert_eq!(
                text.matches("ExecStart=").count(),
                1,
                "{name}: one ExecStart"
            );
            assert!(
                text.contains(&installed),
                "{name}: runs /usr/local/bin/{bin}"
            );
            let built = integration_tests::bin(bin);
            text = text.replace(&installed, &format!("ExecStart={} ", built.display()));
        }
        fs::write(tmp.path().join(&name), text).unwrap();
        names.push(name);
    }
    for (file, _, _) in SERVICES {
        assert!(
            names.iter().any(|n| n == file),
            "deploy/systemd/{file} exists"
        );
    }
    assert!(names.iter().any(|n| n == "pdserve.target"));

    let mut to_verify: Vec<&str> = SERVICES.iter().map(|(_, _, unit)| *unit).collect();
    to_verify.push("pdserve.target");
    for unit in to_verify {
        let out = Command::new(&analyze)
            .args(["verify", "--man=no", "--no-pager"])
            .arg(tmp.path().join(unit))
            .env("SYSTEMD_LOG_COLOR", "0")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let ours: Vec<&str> = text
            .lines()
            .filter(|line| {
                line.contains("pdserve")
                    || line.contains(tmp.path().to_str().unwrap())
                    || names.iter().any(|n| line.contains(n.as_str()))
            })
            .collect();
        assert!(
            out.status.success() && ours.is_empty(),
            "systemd-analyze verify {unit}: {}\n{text}",
            out.status
        );
    }
}

#[test]
fn systemd_units_keep_the_runtime_contract() {
    let dir = deploy_dir().join("systemd");
    for (file, _, _) in SERVICES {
        let worker = file != "pdserve-router.service";
        let text = read(&dir.join(file));
        let d = directives(&text);
        let one = |key: &str| -> &str {
            let v = values(&d, key);
            assert_eq!(v.len(), 1, "{file}: exactly one {key}= ({v:?})");
            v[0]
        };
        assert_eq!(one("Type"), "notify", "{file}");
        assert_eq!(one("NotifyAccess"), "main", "{file}");
        assert!(!one("WatchdogSec").is_empty(), "{file}");
        assert_eq!(one("Restart"), "on-failure", "{file}");
        assert_eq!(one("KillSignal"), "SIGTERM", "{file}");
        assert_eq!(one("KillMode"), "mixed", "{file}");
        assert_eq!(one("User"), "pdserve", "{file}");
        assert_eq!(one("Group"), "pdserve", "{file}");
        assert_eq!(one("NoNewPrivileges"), "yes", "{file}");
        assert_eq!(one("ProtectSystem"), "strict", "{file}");
        assert_eq!(one("CapabilityBoundingSet"), "", "{file}");
        assert_eq!(
            one("LoadCredential"),
            "cluster-secret:/etc/pdserve/cluster.secret",
            "{file}"
        );
        assert_eq!(one("CacheDirectory").split(' ').next(), Some("pdserve"));
        // The drain must fit in the stop timeout: the default grace is 30 s.
        let stop: u64 = one("TimeoutStopSec").parse().unwrap();
        assert!(
            stop > 30,
            "{file}: TimeoutStopSec {stop} above the 30 s grace"
        );
        let start: u64 = one("TimeoutStartSec").parse().unwrap();
        if worker {
            assert!(start >= 600, "{file}: model loads take minutes");
            assert_eq!(one("LimitMEMLOCK"), "infinity", "{file}");
            assert!(values(&d, "PrivateDevices").is_empty(), "{file}: GPUs");
            assert!(
                values(&d, "MemoryDenyWriteExecute").is_empty(),
                "{file}: CUDA JIT"
            );
            // ProtectClock implies a device allow-list, which hides the GPUs.
            assert!(values(&d, "ProtectClock").is_empty(), "{file}");
            assert!(values(&d, "DeviceAllow").is_empty(), "{file}");
        } else {
            assert_eq!(one("PrivateDevices"), "yes", "{file}");
            assert_eq!(one("MemoryDenyWriteExecute"), "yes", "{file}");
        }

        // Every PDSERVE_* variable a unit sets is a setting of its role or a global one: the
        // binary refuses unknown ones at start.
        let role_vars = match file {
            "pdserve-router.service" => setting_vars::<RouterConfig>(),
            "pdserve-prefill@.service" => setting_vars::<PrefillConfig>(),
            _ => setting_vars::<DecodeConfig>(),
        };
        let mut env = BTreeMap::new();
        for assignment in values(&d, "Environment") {
            let (key, value) = assignment.trim_matches('"').split_once('=').unwrap();
            env.insert(key.to_owned(), value.to_owned());
        }
        for key in env.keys().filter(|k| k.starts_with(common::env::PREFIX)) {
            assert!(
                role_vars.contains(key) || common::env::GLOBAL.contains(&key.as_str()),
                "{file}: {key} is not a setting of this role"
            );
        }
        assert_eq!(
            env.get("PDSERVE_CLUSTER_SECRET_FILE").map(String::as_str),
            Some("%d/cluster-secret"),
            "{file}"
        );
        assert_eq!(
            env.get("PDSERVE_CACHE_DIR").map(String::as_str),
            Some("%C/pdserve"),
            "{file}"
        );
    }
}

// ------------------------------------------------------------------------------------------
// example layouts

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Router,
    Prefill,
    Decode,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Router => "router",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

fn role_of(path: &Path) -> Role {
    let name = path.file_name().unwrap().to_str().unwrap();
    [Role::Router, Role::Prefill, Role::Decode]
        .into_iter()
        .find(|role| name.starts_with(role.name()))
        .unwrap_or_else(|| {
            panic!(
                "{}: name a layout file after its role (router, prefill, decode)",
                path.display()
            )
        })
}

/// The `KEY=VALUE` assignments of an `EnvironmentFile=` (comments and blank lines skipped).
fn env_file(path: &Path) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in read(path).lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .unwrap_or_else(|| panic!("{}: not KEY=VALUE: {line}", path.display()));
        let key = key.trim();
        let value = value.trim().trim_matches('"').trim_matches('\'');
        assert!(
            !out.iter().any(|(k, _)| k == key),
            "{}: {key} set twice",
            path.display()
        );
        let allowed = key.starts_with(common::env::PREFIX)
            || key == "CUDA_VISIBLE_DEVICES"
            || key.starts_with("UCX_");
        assert!(
            allowed,
            "{}: {key}: only PDSERVE_*, CUDA_VISIBLE_DEVICES and UCX_* belong in a layout's \
             environment files",
            path.display()
        );
        out.push((key.to_owned(), value.to_owned()));
    }
    out
}

/// What one loaded worker instance says about itself.
#[derive(Debug)]
struct Instance {
    source: String,
    role: Role,
    /// The address others dial: advertised, else the listen address.
    address: String,
    router: Option<String>,
    page_size: u32,
}

#[derive(Debug)]
enum Loaded {
    Router(Box<RouterConfig>),
    Worker(Instance),
}

/// Loads a role's settings from a TOML file (optional) and the PDSERVE_* variables of an
/// environment file, as the binary does at start.
fn load_role(role: Role, toml: Option<&Path>, env: Vec<(String, String)>, source: &str) -> Loaded {
    let env: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with(common::env::PREFIX))
        .collect();
    let secret_unset = |file: Option<&PathBuf>| {
        assert!(
            file.is_none(),
            "{source}: cluster_secret_file is set by the units (credential)"
        );
    };
    let worker = |advertise: Option<String>, listen: std::net::SocketAddr, router, page_size| {
        Loaded::Worker(Instance {
            source: source.to_owned(),
            role,
            address: advertise.unwrap_or_else(|| listen.to_string()),
            router,
            page_size,
        })
    };
    match role {
        Role::Router => {
            let c: RouterConfig =
                load(toml, env, &no_flags()).unwrap_or_else(|e| panic!("{source}: {e}"));
            secret_unset(c.cluster_secret_file.as_ref());
            Loaded::Router(Box::new(c))
        }
        Role::Prefill => {
            let c: PrefillConfig =
                load(toml, env, &no_flags()).unwrap_or_else(|e| panic!("{source}: {e}"));
            let c = c.worker;
            secret_unset(c.cluster_secret_file.as_ref());
            worker(c.advertise_address, c.grpc_listen, c.router, c.page_size)
        }
        Role::Decode => {
            let c: DecodeConfig =
                load(toml, env, &no_flags()).unwrap_or_else(|e| panic!("{source}: {e}"));
            let c = c.worker;
            secret_unset(c.cluster_secret_file.as_ref());
            worker(c.advertise_address, c.grpc_listen, c.router, c.page_size)
        }
    }
}

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, out);
        } else {
            out.push(path);
        }
    }
}

/// Checks one layout folder (with its node subfolders) and returns how many files it loaded.
fn check_layout(layout: &Path) -> usize {
    assert!(
        layout.join("README.md").is_file(),
        "{}: README.md",
        layout.display()
    );
    let mut files = Vec::new();
    files_under(layout, &mut files);
    files.sort();
    let rel = |p: &Path| {
        p.strip_prefix(deploy_dir())
            .unwrap_or(p)
            .display()
            .to_string()
    };
    // Per folder (node): its router's settings, the TOML merged with router.env if present.
    let mut routers: BTreeMap<PathBuf, (String, RouterConfig)> = BTreeMap::new();
    let mut workers = Vec::new();
    let mut loaded = 0;
    for path in &files {
        let folder = path.parent().unwrap().to_path_buf();
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let role = match ext {
            "toml" | "env" => role_of(path),
            "md" => continue,
            _ => panic!("{}: unexpected file in a layout", path.display()),
        };
        loaded += 1;
        if ext == "toml" {
            // A worker TOML that instances share is checked with each instance's environment
            // file below; on its own it must load too.
            let shared = fs::read_dir(&folder).unwrap().any(|e| {
                let path = e.unwrap().path();
                path.extension().is_some_and(|ext| ext == "env")
                    && path
                        .file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(&format!("{}-", role.name())))
            });
            match load_role(role, Some(path), Vec::new(), &rel(path)) {
                Loaded::Router(c) => {
                    routers.entry(folder).or_insert((rel(path), *c));
                }
                Loaded::Worker(instance) if !shared => workers.push(instance),
                Loaded::Worker(_) => {}
            }
        } else {
            let base = folder.join(format!("{}.toml", role.name()));
            let toml = base.is_file().then_some(base.as_path());
            match load_role(role, toml, env_file(path), &rel(path)) {
                Loaded::Router(c) => {
                    routers.insert(folder, (rel(path), *c));
                }
                Loaded::Worker(instance) => workers.push(instance),
            }
        }
    }

    // The instances fit together: one page size, distinct addresses, each registered with a
    // router of the layout that runs the PD backend.
    assert!(!routers.is_empty(), "{}: a router", layout.display());
    assert!(
        workers.iter().any(|w| w.role == Role::Prefill)
            && workers.iter().any(|w| w.role == Role::Decode),
        "{}: prefill and decode workers",
        layout.display()
    );
    let page_sizes: BTreeSet<u32> = workers.iter().map(|w| w.page_size).collect();
    assert_eq!(
        page_sizes.len(),
        1,
        "{}: one page_size: {workers:?}",
        layout.display()
    );
    let mut addresses = BTreeMap::new();
    for w in &workers {
        if let Some(other) = addresses.insert(w.address.clone(), w.source.clone()) {
            panic!("{} and {other} both use {}", w.source, w.address);
        }
        let router = w
            .router
            .as_deref()
            .unwrap_or_else(|| panic!("{}: set `router` (workers register)", w.source));
        assert!(
            routers
                .values()
                .any(|(_, r)| r.grpc_listen.to_string() == router),
            "{}: router {router} is not the gRPC address of a router of this layout",
            w.source
        );
    }
    for (source, router) in routers.values() {
        assert_eq!(
            router.backend,
            BackendKind::Pd,
            "{source}: backend = \"pd\""
        );
        assert!(
            router.model_dir.is_some(),
            "{source}: model_dir (tokenizer)"
        );
    }
    loaded
}

#[test]
fn layout_files_load_with_their_roles_loader() {
    let layouts = deploy_dir().join("layouts");
    let mut names = Vec::new();
    for entry in fs::read_dir(&layouts).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            let loaded = check_layout(&path);
            assert!(loaded > 0, "{}: no files", path.display());
            names.push(path.file_name().unwrap().to_str().unwrap().to_owned());
        }
    }
    names.sort();
    assert_eq!(
        names,
        ["one-node-8gpu", "one-node-8gpu-groups", "two-nodes"]
    );
}

// ------------------------------------------------------------------------------------------
// metric names

/// Every `pdserve_[a-z_]+` token of `text` (not part of a longer word).
fn metric_tokens(text: &str, out: &mut BTreeSet<String>) {
    let bytes = text.as_bytes();
    let mut from = 0;
    while let Some(i) = text[from..].find("pdserve_") {
        let start = from + i;
        let mut end = start + "pdserve_".len();
        while end < bytes.len() && (bytes[end].is_ascii_lowercase() || bytes[end] == b'_') {
            end += 1;
        }
        let inside_word =
            start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        if !inside_word {
            out.insert(text[start..end].to_owned());
        }
        from = end;
    }
}

fn strings_of(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::String(s) => out.push(s.clone()),
        Value::Array(items) => items.iter().for_each(|v| strings_of(v, out)),
        Value::Object(map) => map.values().for_each(|v| strings_of(v, out)),
        _ => {}
    }
}

/// Tokens that are not metrics the router exports (histogram series suffixes stripped).
fn unknown_metrics(tokens: &BTreeSet<String>) -> Vec<String> {
    let known = |name: &str| {
        router::metrics::ALL.contains(&name) || worker_core::metrics::NAMES.contains(&name)
    };
    tokens
        .iter()
        .filter(|t| {
            !known(t)
                && !["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|s| t.strip_suffix(s).is_some_and(known))
        })
        .cloned()
        .collect()
}

#[test]
fn dashboard_is_valid_grafana_json() {
    let path = deploy_dir().join("grafana/pdserve-dashboard.json");
    let dashboard: Value = serde_json::from_str(&read(&path)).unwrap();
    assert!(dashboard["schemaVersion"].as_u64().unwrap() >= 36);
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    let variable = |name: &str| {
        variables
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("variable {name}"))
    };
    assert_eq!(variable("datasource")["type"], "datasource");
    assert_eq!(variable("datasource")["query"], "prometheus");
    assert_eq!(variable("instance")["type"], "query");
    // Workers serve their own families (worker_core::metrics) on their metrics_listen.
    assert_eq!(variable("worker")["type"], "query");

    let panels = dashboard["panels"].as_array().unwrap();
    let rows: Vec<&str> = panels
        .iter()
        .filter(|p| p["type"] == "row")
        .map(|p| p["title"].as_str().unwrap())
        .collect();
    for row in [
        "Traffic",
        "Latency",
        "Throughput",
        "Workers",
        "Transfers",
        "Engine (workers)",
    ] {
        assert!(rows.contains(&row), "row {row} in {rows:?}");
    }
    let mut ids = BTreeSet::new();
    let mut exprs = 0;
    for panel in panels {
        let title = panel["title"].as_str().unwrap();
        assert!(ids.insert(panel["id"].as_u64().unwrap()), "{title}: id");
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        assert!(
            panel["description"].as_str().is_some_and(|d| !d.is_empty()),
            "{title}: description"
        );
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            // The workers' own families follow the worker variable, the routers' the router
            // (instance) variable.
            let variable = if expr.contains("pdserve_engine_") {
                "instance=~\"$worker\""
            } else {
                "instance=~\"$instance\""
            };
            assert!(
                expr.contains(variable),
                "{title}: {expr} follows its variable ({variable})"
            );
            exprs += 1;
        }
    }
    assert!(exprs >= 20, "{exprs} queries");
}

#[test]
fn dashboard_alerts_and_docs_use_exported_metric_names() {
    let dir = deploy_dir();
    let mut report = Vec::new();

    let dashboard: Value =
        serde_json::from_str(&read(&dir.join("grafana/pdserve-dashboard.json"))).unwrap();
    let mut strings = Vec::new();
    strings_of(&dashboard, &mut strings);
    let mut used = BTreeSet::new();
    for s in &strings {
        metric_tokens(s, &mut used);
    }
    assert!(used.len() >= 15, "the dashboard queries metrics: {used:?}");
    report.push(("grafana/pdserve-dashboard.json", unknown_metrics(&used)));

    for file in [
        "prometheus/alerts.yml",
        "prometheus/prometheus.yml",
        "OPERATIONS.md",
        "README.md",
    ] {
        let mut tokens = BTreeSet::new();
        metric_tokens(&read(&dir.join(file)), &mut tokens);
        if file == "prometheus/alerts.yml" {
            assert!(tokens.len() >= 8, "alerts use metrics: {tokens:?}");
        }
        report.push((file, unknown_metrics(&tokens)));
    }
    let bad: Vec<String> = report
        .iter()
        .filter(|(_, unknown)| !unknown.is_empty())
        .map(|(file, unknown)| format!("deploy/{file}: {}", unknown.join(", ")))
        .collect();
    assert!(
        bad.is_empty(),
        "metric names neither in router::metrics::ALL nor in worker_core::metrics::NAMES:\n{}",
        bad.join("\n")
    );
}

/// Every role's built-in settings are valid, and the annotated example of each in
/// deploy/config/ loads and changes keys it shows.
#[test]
fn example_configs_load_and_change_their_defaults() {
    fn check<C: ServiceConfig + PartialEq + std::fmt::Debug>(file: &str) {
        assert!(C::default().validate().is_ok(), "{file}: defaults");
        let path = deploy_dir().join("config").join(file);
        let loaded: C =
            load(Some(&path), Vec::new(), &no_flags()).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_ne!(loaded, C::default(), "{file}");
    }
    check::<RouterConfig>("router.toml");
    check::<PrefillConfig>("prefill.toml");
    check::<DecodeConfig>("decode.toml");
}
