//! Layered service configuration: defaults < TOML file < environment (`PDSERVE_*`) < command line.
//!
//! Each service describes its settings as one serde struct whose `Default` is the built-in
//! configuration. The layers are merged as JSON values (so `Option` settings keep their key),
//! every key is checked against the defaults (unknown keys are errors, never ignored), and the
//! merged value is deserialized once and validated once. Errors name the key and the layer that
//! supplied it, on one line.

use std::{
    collections::BTreeMap,
    fmt,
    net::SocketAddr,
    path::{Path, PathBuf},
};

use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Map, Value};

use crate::env;

/// A service's settings.
pub trait ServiceConfig: Serialize + DeserializeOwned + Default {
    /// Service name used in messages, e.g. `router`.
    const ROLE: &'static str;

    /// The listen address (`host:port`) that vLLM's `--host` and `--port` edit, if the
    /// service takes them ([`crate::cli::HostPortFlags`]).
    const HOST_PORT_KEY: Option<&'static str> = None;

    /// Cross-field and range checks, run once after all layers are merged.
    fn validate(&self) -> Result<(), Invalid>;
}

/// A setting whose value is well-typed but not acceptable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    /// Dotted key, e.g. `page_size_tokens`.
    pub key: String,
    /// Why the value is rejected.
    pub reason: String,
}

impl Invalid {
    pub fn new(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            reason: reason.into(),
        }
    }
}

/// Where a setting's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Default,
    File(PathBuf),
    Env(String),
    Cli(String),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Default => write!(f, "built-in default"),
            Origin::File(path) => write!(f, "file {}", path.display()),
            Origin::Env(var) => write!(f, "env {var}"),
            Origin::Cli(flag) => write!(f, "flag {flag}"),
        }
    }
}

/// Everything that can be wrong with a configuration. Every message is one line and names the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid TOML (line {line}): {message}")]
    ParseFile {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("unknown key `{key}` in {origin}; valid keys: {valid}")]
    UnknownKey {
        key: String,
        origin: Origin,
        valid: String,
    },
    #[error("unknown variable {var}: not a setting of {role}; valid variables: {valid}")]
    UnknownEnv {
        var: String,
        role: &'static str,
        valid: String,
    },
    #[error("`{key}` from {origin}: {message}")]
    InvalidType {
        key: String,
        origin: Origin,
        message: String,
    },
    #[error("`{key}` = {value} from {origin}: {reason}")]
    InvalidValue {
        key: String,
        value: String,
        origin: Origin,
        reason: String,
    },
    #[error("`{key}`: cannot listen on {addr}: {source}")]
    Bind {
        key: String,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("internal: settings of {role} are not a table: {message}")]
    Schema { role: &'static str, message: String },
}

/// The command-line keys of [`crate::cli::HostPortFlags`].
const HOST: &str = "host";
const PORT: &str = "port";

/// `--host` and `--port` (set after every other layer, as the command line is) replace the IP
/// and the port of the service's listen address, whichever layer gave that address.
fn apply_host_port<C: ServiceConfig>(
    merged: &mut Layers<'_>,
    (host, port): (Option<Value>, Option<Value>),
) -> Result<(), ConfigError> {
    if host.is_none() && port.is_none() {
        return Ok(());
    }
    let flags = match (&host, &port) {
        (Some(_), Some(_)) => "--host/--port",
        (Some(_), None) => "--host",
        _ => "--port",
    };
    let Some(key) = C::HOST_PORT_KEY else {
        return Err(ConfigError::UnknownKey {
            key: flags.trim_start_matches('-').to_owned(),
            origin: Origin::Cli(flags.to_owned()),
            valid: "none: this service has no listen address for them".to_owned(),
        });
    };
    let path = [key.to_owned()];
    let current = lookup(&merged.value, &path)
        .and_then(Value::as_str)
        .and_then(|a| a.parse::<SocketAddr>().ok())
        .ok_or_else(|| schema::<C>(&format!("`{key}` is not a socket address")))?;
    let mut addr = current;
    let invalid = |message: String| ConfigError::InvalidType {
        key: key.to_owned(),
        origin: Origin::Cli(flags.to_owned()),
        message,
    };
    if let Some(host) = host {
        let ip = host
            .as_str()
            .and_then(|h| h.parse::<std::net::IpAddr>().ok())
            .ok_or_else(|| invalid(format!("--host {host} is not an IP address")))?;
        addr.set_ip(ip);
    }
    if let Some(port) = port {
        let port = port
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .ok_or_else(|| invalid(format!("--port {port} is not a port number")))?;
        addr.set_port(port);
    }
    set(&mut merged.value, &path, Value::String(addr.to_string()));
    merged
        .origins
        .insert(key.to_owned(), Origin::Cli(flags.to_owned()));
    Ok(())
}

/// Loads `C` from its layers. `env` is usually `std::env::vars()`; `cli` is a serializable
/// struct whose unset flags serialize as `null` or are skipped.
pub fn load<C: ServiceConfig>(
    file: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
    cli: &impl Serialize,
) -> Result<C, ConfigError> {
    let defaults = serde_json::to_value(C::default()).map_err(|e| schema::<C>(&e.to_string()))?;
    let Value::Object(defaults) = defaults else {
        return Err(schema::<C>("defaults do not serialize to a table"));
    };
    let mut merged = Layers {
        defaults: &defaults,
        value: defaults.clone(),
        origins: BTreeMap::new(),
    };

    if let Some(path) = file {
        let table = read_toml(path)?;
        merged.apply(&table, &[], &|_| Origin::File(path.to_path_buf()))?;
    }

    let vars = env_settings(&defaults);
    for (var, raw) in env {
        if !var.starts_with(env::PREFIX) || env::GLOBAL.contains(&var.as_str()) {
            continue;
        }
        let Some(path) = vars.get(&var) else {
            return Err(ConfigError::UnknownEnv {
                var,
                role: C::ROLE,
                valid: vars.keys().cloned().collect::<Vec<_>>().join(", "),
            });
        };
        let default = lookup(&defaults, path).unwrap_or(&Value::Null);
        let value = coerce_env::<C>(&merged.value, path, default, &raw);
        set(&mut merged.value, path, value);
        merged.origins.insert(path.join("."), Origin::Env(var));
    }

    let cli = serde_json::to_value(cli).map_err(|e| schema::<C>(&e.to_string()))?;
    if let Value::Object(cli) = cli {
        let mut cli = strip_nulls(cli);
        let host_port = (cli.remove(HOST), cli.remove(PORT));
        merged.apply(&cli, &[], &|key| {
            Origin::Cli(format!("--{}", key.replace(['_', '.'], "-")))
        })?;
        apply_host_port::<C>(&mut merged, host_port)?;
    }

    let origin_of = |key: &str| merged.origins.get(key).cloned().unwrap_or(Origin::Default);
    let config: C = deserialize(&merged.value, &defaults).map_err(|(key, message)| {
        ConfigError::InvalidType {
            origin: origin_of(&key),
            message,
            key,
        }
    })?;
    config.validate().map_err(|invalid| {
        let path: Vec<String> = invalid.key.split('.').map(str::to_owned).collect();
        let value = lookup(&merged.value, &path).map_or_else(|| "?".to_owned(), Value::to_string);
        ConfigError::InvalidValue {
            origin: origin_of(&invalid.key),
            key: invalid.key,
            value,
            reason: invalid.reason,
        }
    })?;
    Ok(config)
}

/// Checks `min <= value <= max`.
pub fn check_range(key: &str, value: u64, min: u64, max: u64) -> Result<(), Invalid> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(Invalid::new(
            key,
            format!("must be between {min} and {max}"),
        ))
    }
}

/// Checks that an address others dial is `host:port` with a non-zero port.
pub fn check_host_port(key: &str, value: &str) -> Result<(), Invalid> {
    let bad = || {
        Invalid::new(
            key,
            format!("`{value}` is not host:port (e.g. 10.0.0.5:8101 or worker-1:8101)"),
        )
    };
    let (host, port) = value.rsplit_once(':').ok_or_else(bad)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port_ok = port.parse::<u16>().is_ok_and(|p| p != 0);
    let host_ok = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '_'));
    if port_ok && host_ok {
        Ok(())
    } else {
        Err(bad())
    }
}

/// Checks an optional advertised address.
pub fn check_advertise(key: &str, value: Option<&str>) -> Result<(), Invalid> {
    value.map_or(Ok(()), |v| check_host_port(key, v))
}

fn schema<C: ServiceConfig>(message: &str) -> ConfigError {
    ConfigError::Schema {
        role: C::ROLE,
        message: message.to_owned(),
    }
}

struct Layers<'a> {
    defaults: &'a Map<String, Value>,
    value: Map<String, Value>,
    /// Dotted key -> layer that set it last.
    origins: BTreeMap<String, Origin>,
}

impl Layers<'_> {
    /// Merges `layer` over the current value, rejecting keys the defaults do not have.
    fn apply(
        &mut self,
        layer: &Map<String, Value>,
        prefix: &[String],
        origin: &dyn Fn(&str) -> Origin,
    ) -> Result<(), ConfigError> {
        let section = if prefix.is_empty() {
            Some(self.defaults)
        } else {
            match lookup(self.defaults, prefix) {
                Some(Value::Object(map)) => Some(map),
                _ => None,
            }
        };
        for (key, value) in layer {
            let mut path = prefix.to_vec();
            path.push(key.clone());
            let dotted = path.join(".");
            let known = section.and_then(|s| s.get(key));
            let Some(known) = known else {
                return Err(ConfigError::UnknownKey {
                    origin: origin(&dotted),
                    key: dotted,
                    valid: section
                        .map(|s| s.keys().cloned().collect::<Vec<_>>().join(", "))
                        .unwrap_or_default(),
                });
            };
            if let (Value::Object(_), Value::Object(inner)) = (known, value) {
                self.apply(inner, &path, origin)?;
            } else {
                set(&mut self.value, &path, value.clone());
                self.origins.insert(dotted.clone(), origin(&dotted));
            }
        }
        Ok(())
    }
}

fn read_toml(path: &Path) -> Result<Map<String, Value>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
        path: path.to_path_buf(),
        source,
    })?;
    let table: toml::Table = toml::from_str(&text).map_err(|e| ConfigError::ParseFile {
        path: path.to_path_buf(),
        line: e
            .span()
            .map_or(0, |span| text[..span.start].matches('\n').count() + 1),
        message: e.message().replace('\n', " "),
    })?;
    match serde_json::to_value(table) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Ok(Map::new()),
        Err(e) => Err(ConfigError::ParseFile {
            path: path.to_path_buf(),
            line: 0,
            message: e.to_string(),
        }),
    }
}

/// Maps each setting's environment variable to its key path.
fn env_settings(defaults: &Map<String, Value>) -> BTreeMap<String, Vec<String>> {
    fn walk(map: &Map<String, Value>, prefix: &[String], out: &mut BTreeMap<String, Vec<String>>) {
        for (key, value) in map {
            let mut path = prefix.to_vec();
            path.push(key.clone());
            if let Value::Object(inner) = value {
                walk(inner, &path, out);
            } else {
                let parts: Vec<&str> = path.iter().map(String::as_str).collect();
                out.insert(env::setting_var(&parts), path);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(defaults, &[], &mut out);
    out
}

/// The merged table as `C`, or the key whose value does not fit and why. serde names the key
/// itself except inside a `#[serde(flatten)]` part (a table several services share), where its
/// path is lost: then the key is found by putting each changed value alone over the defaults.
fn deserialize<C: ServiceConfig>(
    merged: &Map<String, Value>,
    defaults: &Map<String, Value>,
) -> Result<C, (String, String)> {
    let error = match serde_path_to_error::deserialize::<_, C>(Value::Object(merged.clone())) {
        Ok(config) => return Ok(config),
        Err(e) => e,
    };
    let named = |e: &serde_path_to_error::Error<serde_json::Error>| {
        let path = e.path().to_string();
        (path != "." && path != "?").then_some(path)
    };
    if let Some(path) = named(&error) {
        return Err((path, error.into_inner().to_string()));
    }
    let mut changed = Vec::new();
    changed_leaves(merged, defaults, &mut Vec::new(), &mut changed);
    for (path, value) in changed {
        let mut trial = defaults.clone();
        set(&mut trial, &path, value);
        if let Err(e) = serde_path_to_error::deserialize::<_, C>(Value::Object(trial)) {
            let key = named(&e).unwrap_or_else(|| path.join("."));
            return Err((key, e.into_inner().to_string()));
        }
    }
    Err((".".to_owned(), error.into_inner().to_string()))
}

/// The paths (into nested tables) where `merged` differs from `defaults`, with their values.
fn changed_leaves(
    merged: &Map<String, Value>,
    defaults: &Map<String, Value>,
    prefix: &mut Vec<String>,
    out: &mut Vec<(Vec<String>, Value)>,
) {
    for (key, value) in merged {
        prefix.push(key.clone());
        match (value, defaults.get(key)) {
            (Value::Object(inner), Some(Value::Object(default))) => {
                changed_leaves(inner, default, prefix, out);
            }
            (value, default) if default != Some(value) => out.push((prefix.clone(), value.clone())),
            _ => {}
        }
        prefix.pop();
    }
}

/// Environment values are strings; give them the type the default has. A value that does not
/// parse stays a string so that deserialization reports the key with the expected type.
fn coerce_env<C: ServiceConfig>(
    current: &Map<String, Value>,
    path: &[String],
    default: &Value,
    raw: &str,
) -> Value {
    let text = Value::String(raw.to_owned());
    match default {
        Value::Bool(_) => match raw.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Value::Bool(true),
            "false" | "0" | "no" | "off" => Value::Bool(false),
            _ => text,
        },
        Value::Number(_) => {
            serde_json::from_str::<serde_json::Number>(raw.trim()).map_or(text, Value::Number)
        }
        Value::Array(items) => {
            if raw.trim_start().starts_with('[') {
                serde_json::from_str(raw).unwrap_or(text)
            } else {
                let element = items
                    .first()
                    .cloned()
                    .unwrap_or(Value::String(String::new()));
                Value::Array(
                    raw.split(',')
                        .map(str::trim)
                        .filter(|s| !s.is_empty())
                        .map(|s| coerce_env::<C>(current, path, &element, s))
                        .collect(),
                )
            }
        }
        Value::String(_) | Value::Object(_) => text,
        // Optional settings have no default to learn the type from: take the parsed JSON
        // reading if the whole configuration accepts it there, otherwise the string.
        Value::Null => match serde_json::from_str::<Value>(raw) {
            Ok(parsed) if !parsed.is_string() => {
                let mut trial = current.clone();
                set(&mut trial, path, parsed.clone());
                let fits = deserialize::<C>(&trial, current)
                    .err()
                    .is_none_or(|(key, _)| key != path.join("."));
                if fits { parsed } else { text }
            }
            _ => text,
        },
    }
}

fn strip_nulls(map: Map<String, Value>) -> Map<String, Value> {
    map.into_iter()
        .filter_map(|(k, v)| match v {
            Value::Null => None,
            Value::Object(inner) => Some((k, Value::Object(strip_nulls(inner)))),
            other => Some((k, other)),
        })
        .collect()
}

fn lookup<'a>(map: &'a Map<String, Value>, path: &[String]) -> Option<&'a Value> {
    let (first, rest) = path.split_first()?;
    let value = map.get(first)?;
    if rest.is_empty() {
        Some(value)
    } else if let Value::Object(inner) = value {
        lookup(inner, rest)
    } else {
        None
    }
}

fn set(map: &mut Map<String, Value>, path: &[String], value: Value) {
    let Some((first, rest)) = path.split_first() else {
        return;
    };
    if rest.is_empty() {
        map.insert(first.clone(), value);
        return;
    }
    let entry = map
        .entry(first.clone())
        .or_insert_with(|| Value::Object(Map::new()));
    if !entry.is_object() {
        *entry = Value::Object(Map::new());
    }
    if let Value::Object(inner) = entry {
        set(inner, rest, value);
    }
}

#[cfg(test)]
mod tests;
