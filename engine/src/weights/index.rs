//! `model.safetensors.index.json`: the shard map shipped with sharded checkpoints. When it is
//! present it must agree with the shards exactly (every file it names exists, every tensor is
//! where it says, no shard or tensor is left out), so a partial or mixed download is an error
//! naming the file and tensor instead of a model assembled from whatever is on disk.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use super::LoadError;

/// The index file's name in a checkpoint folder.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Tensor name to shard file name, from the index in `dir`; None when the folder has none.
pub fn read(dir: &Path) -> Result<Option<BTreeMap<String, String>>, LoadError> {
    let path = dir.join(INDEX_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(bad(&path, format!("cannot read: {e}"))),
    };
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(&path, format!("not valid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| bad(&path, "has no \"weight_map\" object".to_owned()))?;
    let mut out = BTreeMap::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .filter(|f| is_plain_file_name(f))
            .ok_or_else(|| {
                bad(
                    &path,
                    format!("maps tensor {tensor} to {file}, which is not a shard file name"),
                )
            })?;
        out.insert(tensor.clone(), file.to_owned());
    }
    Ok(Some(out))
}

/// A file name inside the folder (no separators or parent references).
fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\'])
}

fn bad(path: &Path, message: String) -> LoadError {
    LoadError::Index {
        path: path.to_path_buf(),
        message,
    }
}

/// Checks the shards on disk (`tensors`: tensor name to the shard holding it) against the
/// index. `shards` are the shard files found in `dir`.
pub fn check(
    dir: &Path,
    index: &BTreeMap<String, String>,
    shards: &[PathBuf],
    tensors: &BTreeMap<String, PathBuf>,
) -> Result<(), LoadError> {
    let path = dir.join(INDEX_FILE);
    let name_of = |p: &Path| {
        p.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    let on_disk: BTreeMap<String, &PathBuf> = shards.iter().map(|p| (name_of(p), p)).collect();
    for (tensor, file) in index {
        if !on_disk.contains_key(file) {
            return Err(bad(
                &path,
                format!("names shard {file} (for tensor {tensor}), which is not in the folder"),
            ));
        }
        match tensors.get(tensor) {
            None => {
                return Err(bad(
                    &path,
                    format!("places tensor {tensor} in {file}, which does not hold it"),
                ));
            }
            Some(actual) if name_of(actual) != *file => {
                return Err(bad(
                    &path,
                    format!(
                        "places tensor {tensor} in {file}, but it is in {}",
                        name_of(actual)
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    let named: std::collections::BTreeSet<&String> = index.values().collect();
    if let Some(stray) = on_disk.keys().find(|f| !named.contains(f)) {
        return Err(bad(
            &path,
            format!("does not name shard {stray}, which is in the folder (a mixed download?)"),
        ));
    }
    if let Some((tensor, file)) = tensors.iter().find(|(t, _)| !index.contains_key(*t)) {
        return Err(bad(
            &path,
            format!(
                "does not list tensor {tensor}, which is in {}",
                name_of(file)
            ),
        ));
    }
    Ok(())
}
