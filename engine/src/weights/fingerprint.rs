//! The model fingerprint in every state layout: prefill and decode workers refuse to pair
//! unless theirs are equal, so state computed with one checkpoint is never continued with
//! another.

use std::path::Path;

use sha2::{Digest, Sha256};

use super::{Checkpoint, LoadError};

/// Tensors up to this size are hashed whole; larger ones by their length and both ends.
const WHOLE_TENSOR_BYTES: usize = 1 << 20;
/// Bytes hashed at each end of a large tensor.
const SAMPLE_BYTES: usize = 64 << 10;

/// Hex sha256 over the canonical `config.json` and, for every tensor in name order, its name,
/// dtype, shape and content: small tensors whole, large ones by their first and last 64 KiB.
/// Two checkpoints with different weights differ in practically every tensor, so the samples
/// tell them apart, while a worker on a multi-hundred-gigabyte checkpoint still starts in
/// seconds. The same files give the same fingerprint on every host.
pub fn fingerprint(dir: &Path) -> Result<String, LoadError> {
    let config_path = dir.join("config.json");
    let text = std::fs::read(&config_path).map_err(|source| LoadError::ReadDir {
        path: config_path.clone(),
        source,
    })?;
    let config: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| LoadError::ReadDir {
            path: config_path,
            source: std::io::Error::other(e),
        })?;
    let checkpoint = Checkpoint::open(dir)?;
    let mut h = Sha256::new();
    h.update(b"pdserve-model-fingerprint-v1\0");
    let mut canonical = String::new();
    canonical_json(&config, &mut canonical);
    h.update(canonical.as_bytes());
    for name in checkpoint.index.keys() {
        let view = checkpoint.view(name)?;
        h.update(b"\0");
        h.update(name.as_bytes());
        h.update(b"\0");
        h.update(view.dtype.name().as_bytes());
        for &d in view.shape {
            h.update((d as u64).to_le_bytes());
        }
        h.update((view.data.len() as u64).to_le_bytes());
        if view.data.len() <= WHOLE_TENSOR_BYTES {
            h.update(view.data);
        } else {
            h.update(&view.data[..SAMPLE_BYTES]);
            h.update(&view.data[view.data.len() - SAMPLE_BYTES..]);
        }
    }
    Ok(h.finalize()
        .iter()
        .fold(String::with_capacity(64), |mut hex, b| {
            use std::fmt::Write as _;
            let _ = write!(hex, "{b:02x}");
            hex
        }))
}

/// Compact JSON with every object's keys sorted. `Value::to_string` keeps the file's key order
/// when some crate in the build enables serde_json's `preserve_order` (feature unification
/// differs between builds of different binaries), so it cannot be hashed as is.
fn canonical_json(value: &serde_json::Value, out: &mut String) {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                canonical_json(&map[key], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical_json(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_json_ignores_key_order_and_spacing() {
        let a: serde_json::Value =
            serde_json::from_str(r#"{"b": [1, {"z": 2.5, "a": "x\"y"}], "a": null, "c": true}"#)
                .unwrap_or_default();
        let b: serde_json::Value =
            serde_json::from_str(r#"{"c":true,"a":null,"b":[1,{"a":"x\"y","z":2.5}]}"#)
                .unwrap_or_default();
        let (mut x, mut y) = (String::new(), String::new());
        canonical_json(&a, &mut x);
        canonical_json(&b, &mut y);
        assert_eq!(x, r#"{"a":null,"b":[1,{"a":"x\"y","z":2.5}],"c":true}"#);
        assert_eq!(x, y);
    }
}
