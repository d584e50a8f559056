use std::{io::Write, net::SocketAddr, path::PathBuf};

use serde::{Deserialize, Serialize};

use super::*;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Demo {
    listen: SocketAddr,
    pages: u32,
    ratio: f64,
    verbose: bool,
    name: String,
    peers: Vec<String>,
    model_dir: Option<PathBuf>,
    seed: Option<u64>,
    tls: Tls,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Tls {
    enabled: bool,
    cert_file: String,
}

impl Default for Tls {
    fn default() -> Self {
        Self {
            enabled: false,
            cert_file: "cert.pem".into(),
        }
    }
}

impl Default for Demo {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7000".parse().unwrap(),
            pages: 16,
            ratio: 0.5,
            verbose: false,
            name: "demo".into(),
            peers: vec![],
            model_dir: None,
            seed: None,
            tls: Tls::default(),
        }
    }
}

impl ServiceConfig for Demo {
    const ROLE: &'static str = "demo";
    fn validate(&self) -> Result<(), Invalid> {
        if self.pages == 0 {
            return Err(Invalid::new("pages", "must be at least 1"));
        }
        Ok(())
    }
}

#[derive(Serialize, Default)]
struct Cli {
    #[serde(skip_serializing_if = "Option::is_none")]
    pages: Option<u32>,
    name: Option<String>,
    bogus: Option<u32>,
}

fn no_env() -> Vec<(String, String)> {
    vec![]
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn toml_file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

#[test]
fn defaults_only() {
    let c: Demo = load(None, no_env(), &Cli::default()).unwrap();
    assert_eq!(c, Demo::default());
}

#[test]
fn layers_override_in_order() {
    let file =
        toml_file("pages = 20\nname = \"file\"\nverbose = true\n[tls]\ncert_file = \"f.pem\"\n");
    let e = env(&[("PDSERVE_PAGES", "30"), ("PDSERVE_TLS__ENABLED", "true")]);
    let cli = Cli {
        pages: Some(40),
        ..Cli::default()
    };
    let c: Demo = load(Some(file.path()), e, &cli).unwrap();
    assert_eq!(c.pages, 40, "cli beats env beats file");
    assert_eq!(c.name, "file");
    assert!(c.verbose);
    assert!(c.tls.enabled);
    assert_eq!(c.tls.cert_file, "f.pem");

    let e = env(&[("PDSERVE_PAGES", "30")]);
    let c: Demo = load(Some(file.path()), e, &Cli::default()).unwrap();
    assert_eq!(c.pages, 30, "env beats file");
}

#[test]
fn env_types_follow_defaults() {
    let e = env(&[
        ("PDSERVE_NAME", "123"),
        ("PDSERVE_RATIO", "0.25"),
        ("PDSERVE_PEERS", "a:1, b:2"),
        ("PDSERVE_SEED", "7"),
        ("PDSERVE_MODEL_DIR", "42"),
        ("PDSERVE_LOG", "debug"),
        ("PATH", "/bin"),
    ]);
    let c: Demo = load(None, e, &Cli::default()).unwrap();
    assert_eq!(c.name, "123");
    assert!((c.ratio - 0.25).abs() < f64::EPSILON);
    assert_eq!(c.peers, vec!["a:1".to_owned(), "b:2".to_owned()]);
    assert_eq!(c.seed, Some(7));
    assert_eq!(c.model_dir, Some(PathBuf::from("42")));
}

#[test]
fn unknown_file_key_is_named() {
    let file = toml_file("pagez = 3\n");
    let err = load::<Demo>(Some(file.path()), no_env(), &Cli::default()).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, ConfigError::UnknownKey { ref key, .. } if key == "pagez"),
        "{msg}"
    );
    assert!(
        msg.contains("`pagez`") && msg.contains("valid keys"),
        "{msg}"
    );
    assert!(!msg.contains('\n'));

    let file = toml_file("[tls]\nkey_file = \"x\"\n");
    let err = load::<Demo>(Some(file.path()), no_env(), &Cli::default()).unwrap_err();
    assert!(err.to_string().contains("`tls.key_file`"), "{err}");
}

#[test]
fn unknown_env_is_named() {
    let err = load::<Demo>(None, env(&[("PDSERVE_PAGEZ", "3")]), &Cli::default()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("PDSERVE_PAGEZ") && msg.contains("PDSERVE_PAGES"),
        "{msg}"
    );
}

#[test]
fn unknown_cli_key_is_named() {
    let cli = Cli {
        bogus: Some(1),
        ..Cli::default()
    };
    let err = load::<Demo>(None, no_env(), &cli).unwrap_err();
    assert!(err.to_string().contains("flag --bogus"), "{err}");
}

#[test]
fn wrong_type_names_key_and_origin() {
    let file = toml_file("pages = \"many\"\n");
    let err = load::<Demo>(Some(file.path()), no_env(), &Cli::default()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with("`pages` from file "), "{msg}");
    assert!(msg.contains("invalid type"), "{msg}");

    let err =
        load::<Demo>(None, env(&[("PDSERVE_LISTEN", "nowhere")]), &Cli::default()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with("`listen` from env PDSERVE_LISTEN"), "{msg}");

    let err =
        load::<Demo>(None, env(&[("PDSERVE_VERBOSE", "maybe")]), &Cli::default()).unwrap_err();
    assert!(err.to_string().contains("`verbose`"), "{err}");

    let err = load::<Demo>(None, env(&[("PDSERVE_SEED", "-1")]), &Cli::default()).unwrap_err();
    assert!(err.to_string().contains("`seed`"), "{err}");
}

#[test]
fn validation_names_key_value_origin() {
    let err = load::<Demo>(None, env(&[("PDSERVE_PAGES", "0")]), &Cli::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "`pages` = 0 from env PDSERVE_PAGES: must be at least 1"
    );
}

#[test]
fn bad_toml_is_one_line_with_line_number() {
    let file = toml_file("pages = 3\nname = \n");
    let err = load::<Demo>(Some(file.path()), no_env(), &Cli::default()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("line 2"), "{msg}");
    assert!(!msg.contains('\n'), "{msg}");
}

#[test]
fn missing_file_is_an_error() {
    let err = load::<Demo>(
        Some(Path::new("/nonexistent/pdserve.toml")),
        no_env(),
        &Cli::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("/nonexistent/pdserve.toml"));
}

mod props {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Any string in any setting yields either a config or a one-line error; never a panic.
        #[test]
        fn arbitrary_env_values_never_panic(key in prop::sample::select(vec![
            "PDSERVE_LISTEN", "PDSERVE_PAGES", "PDSERVE_RATIO", "PDSERVE_VERBOSE",
            "PDSERVE_NAME", "PDSERVE_PEERS", "PDSERVE_MODEL_DIR", "PDSERVE_SEED",
            "PDSERVE_TLS__ENABLED"]), value in ".{0,24}") {
            match load::<Demo>(None, env(&[(key, &value)]), &Cli::default()) {
                Ok(_) => {}
                Err(e) => prop_assert!(!e.to_string().contains('\n')),
            }
        }
    }
}

#[test]
fn host_port_checks() {
    for good in ["127.0.0.1:8101", "worker-1:80", "[::1]:9000", "a.b.c:1"] {
        assert!(check_host_port("k", good).is_ok(), "{good}");
    }
    for bad in [
        "",
        "host",
        "host:",
        ":80",
        "host:0",
        "host:70000",
        "ho st:1",
        "http://h:1",
    ] {
        assert!(check_host_port("k", bad).is_err(), "{bad}");
    }
}

/// Settings several services share, flattened into each one's table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
struct Shared {
    pages: u32,
    router: Option<String>,
    tls: Tls,
}

impl Default for Shared {
    fn default() -> Self {
        Self {
            pages: 16,
            router: None,
            tls: Tls::default(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
struct WithShared {
    #[serde(flatten)]
    shared: Shared,
    stream: bool,
}

impl ServiceConfig for WithShared {
    const ROLE: &'static str = "with-shared";
    fn validate(&self) -> Result<(), Invalid> {
        Ok(())
    }
}

/// Inside a flattened part serde loses the key; the error still names it and its origin.
#[test]
fn flattened_settings_name_key_and_origin() {
    let file = toml_file("stream = true\npages = 3\n[tls]\nenabled = true\n");
    let loaded = load::<WithShared>(Some(file.path()), no_env(), &Cli::default()).unwrap();
    assert_eq!((loaded.shared.pages, loaded.stream), (3, true));
    assert!(loaded.shared.tls.enabled);

    let file = toml_file("pages = \"many\"\n");
    let err = load::<WithShared>(Some(file.path()), no_env(), &Cli::default()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with("`pages` from file "), "{msg}");
    assert!(msg.contains("invalid type"), "{msg}");

    let file = toml_file("[tls]\nenabled = 3\n");
    let err = load::<WithShared>(Some(file.path()), no_env(), &Cli::default()).unwrap_err();
    assert!(
        err.to_string().starts_with("`tls.enabled` from file "),
        "{err}"
    );

    let err =
        load::<WithShared>(None, env(&[("PDSERVE_STREAM", "maybe")]), &Cli::default()).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("`stream` from env PDSERVE_STREAM"),
        "{err}"
    );

    let file = toml_file("pagez = 3\n");
    let err = load::<WithShared>(Some(file.path()), no_env(), &Cli::default()).unwrap_err();
    assert!(err.to_string().contains("unknown key `pagez`"), "{err}");

    // An optional setting from the environment whose JSON reading does not fit stays text.
    let loaded =
        load::<WithShared>(None, env(&[("PDSERVE_ROUTER", "123")]), &Cli::default()).unwrap();
    assert_eq!(loaded.shared.router.as_deref(), Some("123"));
}

/// A service whose `listen` is what `--host` and `--port` edit.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
struct Listening {
    #[serde(flatten)]
    demo: Demo,
}

impl ServiceConfig for Listening {
    const ROLE: &'static str = "listening";
    const HOST_PORT_KEY: Option<&'static str> = Some("listen");
    fn validate(&self) -> Result<(), Invalid> {
        Ok(())
    }
}

#[derive(Serialize, Default)]
struct HostPortCli {
    #[serde(skip_serializing_if = "Option::is_none")]
    listen: Option<SocketAddr>,
    #[serde(flatten)]
    host_port: crate::cli::HostPortFlags,
}

fn host_port(host: Option<&str>, port: Option<u16>) -> HostPortCli {
    HostPortCli {
        listen: None,
        host_port: crate::cli::HostPortFlags {
            host: host.map(str::to_owned),
            port,
        },
    }
}

/// vLLM's `--host` and `--port` replace their part of the listen address whichever layer set
/// it; a bad value, or a service without a listen address for them, is an error naming them.
#[test]
fn host_and_port_edit_the_listen_address() {
    let load_with = |file: Option<&std::path::Path>, cli: &HostPortCli| {
        load::<Listening>(file, no_env(), cli).map(|c| c.demo.listen.to_string())
    };
    assert_eq!(
        load_with(None, &host_port(None, Some(9000))).unwrap(),
        "127.0.0.1:9000"
    );
    assert_eq!(
        load_with(None, &host_port(Some("0.0.0.0"), None)).unwrap(),
        "0.0.0.0:7000"
    );
    let file = toml_file("listen = \"10.0.0.5:8100\"\n");
    assert_eq!(
        load_with(Some(file.path()), &host_port(None, Some(8200))).unwrap(),
        "10.0.0.5:8200"
    );
    let mut cli = host_port(Some("::1"), Some(8300));
    cli.listen = Some("127.0.0.1:1".parse().unwrap());
    assert_eq!(load_with(None, &cli).unwrap(), "[::1]:8300");

    let err = load_with(None, &host_port(Some("localhost"), None)).unwrap_err();
    assert!(err.to_string().contains("--host"), "{err}");
    assert!(err.to_string().contains("not an IP address"), "{err}");
    let err = load::<Demo>(None, no_env(), &host_port(None, Some(1))).unwrap_err();
    assert!(err.to_string().contains("--port"), "{err}");
}
