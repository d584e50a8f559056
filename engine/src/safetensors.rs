//! A self-contained reader and writer for the safetensors checkpoint format.
//!
//! Layout: an 8-byte little-endian `u64` header length `N`, then `N` bytes of UTF-8 JSON (an
//! object mapping tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` plus an
//! optional `"__metadata__"` object of strings, possibly padded with trailing spaces), then the
//! data section that the offsets index into.
//!
//! The reader memory-maps the file and validates the whole header at open, so that every later
//! [`SafetensorsFile::get`] is a bounds-checked slice and never fails for a present name. A
//! checkpoint that is truncated, overlapping or has unaccounted bytes is rejected up front with
//! an error naming the file and tensor, instead of surfacing as garbage weights later.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::Mmap;
use serde_json::{Map, Value};

use crate::formats::{bf16_to_f32, f16_to_f32};

/// Largest header accepted; real checkpoints' headers are a few MiB, so anything larger is
/// corruption and would only waste memory on JSON parsing.
pub const MAX_HEADER_LEN: u64 = 100 * 1024 * 1024;

const METADATA_KEY: &str = "__metadata__";

/// Element types the reader understands, named as in the safetensors header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    F8E4M3,
    F8E8M0,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    I64,
    U64,
    F64,
}

impl Dtype {
    /// Every dtype, for parsing by name.
    pub const ALL: [Dtype; 15] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8E4M3,
        Dtype::F8E8M0,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::I64,
        Dtype::U64,
        Dtype::F64,
    ];

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E4M3 | Dtype::F8E8M0 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::I64 | Dtype::U64 | Dtype::F64 => 8,
        }
    }

    /// The header spelling, e.g. `"F8_E4M3"`.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E8M0 => "F8_E8M0",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
            Dtype::F64 => "F64",
        }
    }

    /// Parses the header spelling (case-sensitive, as the format defines it).
    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a checkpoint was rejected at open. Every variant names the file; tensor-level problems
/// also name the tensor.
#[derive(Debug, thiserror::Error)]
pub enum SafetensorsError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("{}: {len} bytes is too short for the 8-byte header length", path.display())]
    TooShort { path: PathBuf, len: u64 },
    #[error("{}: header length {header_len} exceeds the {limit}-byte limit", path.display())]
    HeaderTooLarge {
        path: PathBuf,
        header_len: u64,
        limit: u64,
    },
    #[error(
        "{}: header length {header_len} runs past the end of the {file_len}-byte file",
        path.display()
    )]
    HeaderBeyondFile {
        path: PathBuf,
        header_len: u64,
        file_len: u64,
    },
    #[error("{}: header is not UTF-8: {source}", path.display())]
    HeaderNotUtf8 {
        path: PathBuf,
        source: std::str::Utf8Error,
    },
    #[error("{}: header is not valid JSON: {source}", path.display())]
    HeaderNotJson {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{}: header JSON is not an object", path.display())]
    HeaderNotObject { path: PathBuf },
    #[error("{}: \"__metadata__\" must be an object of strings: {reason}", path.display())]
    BadMetadata { path: PathBuf, reason: String },
    #[error("{}: tensor {tensor:?} has unknown dtype {dtype:?}", path.display())]
    UnknownDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("{}: tensor {tensor:?} has a malformed entry: {reason}", path.display())]
    MalformedEntry {
        path: PathBuf,
        tensor: String,
        reason: &'static str,
    },
    #[error(
        "{}: tensor {tensor:?} has data_offsets [{begin}, {end}] with end before begin",
        path.display()
    )]
    OffsetsReversed {
        path: PathBuf,
        tensor: String,
        begin: u64,
        end: u64,
    },
    #[error("{}: tensor {tensor:?} has a shape whose byte size overflows", path.display())]
    ShapeOverflow { path: PathBuf, tensor: String },
    #[error(
        "{}: tensor {tensor:?} spans {actual} bytes but its dtype and shape need {expected}",
        path.display()
    )]
    LengthMismatch {
        path: PathBuf,
        tensor: String,
        expected: u64,
        actual: u64,
    },
    #[error(
        "{}: tensor {tensor:?} ends at data byte {end} but the data section has only {data_len} \
         bytes (truncated file?)",
        path.display()
    )]
    Truncated {
        path: PathBuf,
        tensor: String,
        end: u64,
        data_len: u64,
    },
    #[error("{}: tensors {first:?} and {second:?} overlap", path.display())]
    Overlap {
        path: PathBuf,
        first: String,
        second: String,
    },
    #[error(
        "{}: data bytes {begin}..{end} belong to no tensor (after {}, before {})",
        path.display(),
        describe(.after.as_deref()),
        describe(.before.as_deref())
    )]
    Hole {
        path: PathBuf,
        begin: u64,
        end: u64,
        /// The tensor ending where the hole begins (None at the start of the data section).
        after: Option<String>,
        /// The tensor starting where the hole ends (None for trailing bytes).
        before: Option<String>,
    },
}

fn describe(tensor: Option<&str>) -> String {
    tensor.map_or_else(|| "nothing".to_owned(), |t| format!("{t:?}"))
}

/// A borrowed tensor: dtype, shape and its little-endian bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorView<'a> {
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

impl TensorView<'_> {
    /// Number of elements (1 for a scalar). Saturates instead of overflowing for hand-built
    /// views; views from [`SafetensorsFile`] were checked at open.
    pub fn numel(&self) -> usize {
        self.shape.iter().fold(1usize, |n, &d| n.saturating_mul(d))
    }

    /// Widens F32, BF16 or F16 data (little-endian) to f32. None for any other dtype, and for
    /// a hand-built view whose byte length does not match its dtype and shape (views from
    /// [`SafetensorsFile`] always match).
    pub fn to_f32_vec(&self) -> Option<Vec<f32>> {
        let expected = self
            .shape
            .iter()
            .try_fold(self.dtype.size_bytes(), |n, &d| n.checked_mul(d))?;
        if expected != self.data.len() {
            return None;
        }
        match self.dtype {
            Dtype::F32 => Some(
                self.data
                    .as_chunks::<4>()
                    .0
                    .iter()
                    .map(|&b| f32::from_le_bytes(b))
                    .collect(),
            ),
            Dtype::BF16 => Some(
                self.data
                    .as_chunks::<2>()
                    .0
                    .iter()
                    .map(|&b| bf16_to_f32(u16::from_le_bytes(b)))
                    .collect(),
            ),
            Dtype::F16 => Some(
                self.data
                    .as_chunks::<2>()
                    .0
                    .iter()
                    .map(|&b| f16_to_f32(u16::from_le_bytes(b)))
                    .collect(),
            ),
            _ => None,
        }
    }
}

#[derive(Debug)]
struct Entry {
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range within the data section.
    begin: usize,
    end: usize,
}

/// An opened, fully validated, memory-mapped safetensors file.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    mmap: Arc<Mmap>,
    /// Offset of the data section within the file (8 + header length).
    data_start: usize,
    tensors: BTreeMap<String, Entry>,
    metadata: BTreeMap<String, String>,
}

impl SafetensorsFile {
    /// Maps `path` read-only and validates its header and data layout.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, SafetensorsError> {
        let path = path.as_ref().to_path_buf();
        let io_err = |source| SafetensorsError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io_err)?;
        let len = file.metadata().map_err(io_err)?.len();
        // Checked before mapping: a zero-length mapping is an error on some platforms.
        if len < 8 {
            return Err(SafetensorsError::TooShort {
                path: path.clone(),
                len,
            });
        }
        // SAFETY: the file is opened read-only and the mapping is never written through. We
        // treat the checkpoint as immutable while it is open; like every mmap-based loader we
        // rely on nobody truncating or rewriting it underneath us (our own writer replaces
        // files by rename, which leaves existing mappings intact).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io_err)?;
        let (data_start, tensors, metadata) = parse(&path, &mmap)?;
        Ok(SafetensorsFile {
            path,
            mmap: Arc::new(mmap),
            data_start,
            tensors,
            metadata,
        })
    }

    /// Drops this process's resident pages of the mapping (`madvise(MADV_DONTNEED)`): its RSS
    /// falls by what was read through it, the data stays in the page cache and a later read
    /// faults it back in from there or from the file. For a reader done with a shard (a
    /// device backend after uploading it).
    pub fn release_resident(&self) -> std::io::Result<()> {
        // SAFETY: the mapping is read-only and shared, so no private copy of a page exists to
        // be lost: after DONTNEED every byte reads back as the file's, which is what any
        // outstanding borrow already sees (the same immutability assumption as `open`).
        unsafe {
            self.mmap
                .unchecked_advise(memmap2::UncheckedAdvice::DontNeed)
        }
    }

    /// Tensor names in sorted (byte-wise) order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The named tensor, or None if the file has no such tensor.
    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        let entry = self.tensors.get(name)?;
        // In range by construction (validated at open); `get` keeps this panic-free anyway.
        let data = self
            .mmap
            .get(self.data_start + entry.begin..self.data_start + entry.end)?;
        Some(TensorView {
            dtype: entry.dtype,
            shape: &entry.shape,
            data,
        })
    }

    /// The named tensor's bytes as a range of the shared mapping, which they keep alive: a
    /// weight built on them holds the file's pages, not a copy.
    pub fn shared(&self, name: &str) -> Option<crate::tensor::SharedBytes> {
        let entry = self.tensors.get(name)?;
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = self.mmap.clone();
        crate::tensor::SharedBytes::new(
            owner,
            self.data_start + entry.begin..self.data_start + entry.end,
        )
    }

    /// Bytes of the whole file.
    pub fn file_len(&self) -> usize {
        self.mmap.len()
    }

    /// The `__metadata__` map (empty when absent).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True when the file holds no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
}

type Parsed = (usize, BTreeMap<String, Entry>, BTreeMap<String, String>);

/// Validates the whole file image; see the module docs for the rules.
fn parse(path: &Path, bytes: &[u8]) -> Result<Parsed, SafetensorsError> {
    let file_len = bytes.len() as u64;
    let Some((len_bytes, rest)) = bytes.split_first_chunk::<8>() else {
        return Err(SafetensorsError::TooShort {
            path: path.to_path_buf(),
            len: file_len,
        });
    };
    let header_len = u64::from_le_bytes(*len_bytes);
    if header_len > MAX_HEADER_LEN {
        return Err(SafetensorsError::HeaderTooLarge {
            path: path.to_path_buf(),
            header_len,
            limit: MAX_HEADER_LEN,
        });
    }
    // header_len <= 100 MiB, so the conversion cannot fail on any supported platform.
    let header_bytes = usize::try_from(header_len)
        .ok()
        .and_then(|n| rest.get(..n))
        .ok_or_else(|| SafetensorsError::HeaderBeyondFile {
            path: path.to_path_buf(),
            header_len,
            file_len,
        })?;
    let data_start = 8 + header_bytes.len();
    let data_len = (bytes.len() - data_start) as u64;

    let header =
        std::str::from_utf8(header_bytes).map_err(|source| SafetensorsError::HeaderNotUtf8 {
            path: path.to_path_buf(),
            source,
        })?;
    // serde_json accepts trailing whitespace, which covers the space padding, and limits
    // nesting depth, so hostile headers cannot overflow the stack.
    let json: Value =
        serde_json::from_str(header).map_err(|source| SafetensorsError::HeaderNotJson {
            path: path.to_path_buf(),
            source,
        })?;
    let Value::Object(object) = json else {
        return Err(SafetensorsError::HeaderNotObject {
            path: path.to_path_buf(),
        });
    };

    let mut metadata = BTreeMap::new();
    let mut tensors = BTreeMap::new();
    // (begin, end, name) in data-section bytes, for the coverage check below.
    let mut ranges: Vec<(u64, u64, String)> = Vec::with_capacity(object.len());
    for (name, value) in object {
        if name == METADATA_KEY {
            metadata = parse_metadata(path, value)?;
            continue;
        }
        let entry = parse_entry(path, &name, &value, data_len)?;
        ranges.push((entry.begin as u64, entry.end as u64, name.clone()));
        tensors.insert(name, entry);
    }
    check_coverage(path, ranges, data_len)?;
    Ok((data_start, tensors, metadata))
}

fn parse_metadata(path: &Path, value: Value) -> Result<BTreeMap<String, String>, SafetensorsError> {
    let bad = |reason: String| SafetensorsError::BadMetadata {
        path: path.to_path_buf(),
        reason,
    };
    let Value::Object(map) = value else {
        return Err(bad(format!("found {}", json_kind(&value))));
    };
    map.into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k, s)),
            other => Err(bad(format!("key {k:?} holds {}", json_kind(&other)))),
        })
        .collect()
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn parse_entry(
    path: &Path,
    name: &str,
    value: &Value,
    data_len: u64,
) -> Result<Entry, SafetensorsError> {
    let malformed = |reason| SafetensorsError::MalformedEntry {
        path: path.to_path_buf(),
        tensor: name.to_owned(),
        reason,
    };
    let Value::Object(fields) = value else {
        return Err(malformed("entry is not an object"));
    };
    let dtype_name = fields
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| malformed("\"dtype\" is missing or not a string"))?;
    let dtype = Dtype::from_name(dtype_name).ok_or_else(|| SafetensorsError::UnknownDtype {
        path: path.to_path_buf(),
        tensor: name.to_owned(),
        dtype: dtype_name.to_owned(),
    })?;
    let dims: Vec<u64> = fields
        .get("shape")
        .and_then(Value::as_array)
        .and_then(|dims| dims.iter().map(Value::as_u64).collect())
        .ok_or_else(|| {
            malformed("\"shape\" is missing or not an array of non-negative integers")
        })?;
    let offsets: Vec<u64> = fields
        .get("data_offsets")
        .and_then(Value::as_array)
        .and_then(|o| o.iter().map(Value::as_u64).collect())
        .ok_or_else(|| malformed("\"data_offsets\" is missing or not non-negative integers"))?;
    let &[begin, end] = offsets.as_slice() else {
        return Err(malformed("\"data_offsets\" must hold exactly two numbers"));
    };
    if end < begin {
        return Err(SafetensorsError::OffsetsReversed {
            path: path.to_path_buf(),
            tensor: name.to_owned(),
            begin,
            end,
        });
    }
    let overflow = || SafetensorsError::ShapeOverflow {
        path: path.to_path_buf(),
        tensor: name.to_owned(),
    };
    let shape: Vec<usize> = dims
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<_, _>>()
        .map_err(|_| overflow())?;
    let expected = dims
        .iter()
        .try_fold(dtype.size_bytes() as u64, |n, &d| n.checked_mul(d))
        .ok_or_else(overflow)?;
    if end - begin != expected {
        return Err(SafetensorsError::LengthMismatch {
            path: path.to_path_buf(),
            tensor: name.to_owned(),
            expected,
            actual: end - begin,
        });
    }
    if end > data_len {
        return Err(SafetensorsError::Truncated {
            path: path.to_path_buf(),
            tensor: name.to_owned(),
            end,
            data_len,
        });
    }
    // Both fit: end <= data_len, which is a length of an in-memory slice.
    Ok(Entry {
        dtype,
        shape,
        begin: begin as usize,
        end: end as usize,
    })
}

/// The data section must be tiled exactly by the tensors: no overlaps (two names aliasing the
/// same bytes is almost certainly a broken writer) and no holes (unaccounted bytes mean the
/// header and data disagree, e.g. a tensor was dropped from the header).
fn check_coverage(
    path: &Path,
    mut ranges: Vec<(u64, u64, String)>,
    data_len: u64,
) -> Result<(), SafetensorsError> {
    ranges.sort();
    let mut cursor = 0u64;
    let mut previous: Option<String> = None;
    for (begin, end, name) in ranges {
        if begin < cursor {
            return Err(SafetensorsError::Overlap {
                path: path.to_path_buf(),
                first: previous.unwrap_or_default(),
                second: name,
            });
        }
        if begin > cursor {
            return Err(SafetensorsError::Hole {
                path: path.to_path_buf(),
                begin: cursor,
                end: begin,
                after: previous,
                before: Some(name),
            });
        }
        cursor = end;
        previous = Some(name);
    }
    if cursor != data_len {
        return Err(SafetensorsError::Hole {
            path: path.to_path_buf(),
            begin: cursor,
            end: data_len,
            after: previous,
            before: None,
        });
    }
    Ok(())
}

/// One tensor to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Little-endian element bytes, exactly `numel * dtype.size_bytes()` long.
    pub data: Vec<u8>,
}

/// Writes a safetensors file deterministically: tensors sorted by name with data laid out in
/// that order, compact JSON with sorted keys (`__metadata__` omitted when empty), and the
/// header padded with spaces to a multiple of 8 so the data section is 8-byte aligned. The
/// same input always yields the same bytes.
///
/// The file is written to a temporary sibling and renamed into place, so readers never see a
/// partial file. Invalid input (duplicate or reserved names, data of the wrong length) is an
/// `InvalidInput` error and writes nothing.
pub fn write(
    path: &Path,
    tensors: &[WriteTensor],
    metadata: &BTreeMap<String, String>,
) -> io::Result<()> {
    let mut sorted: Vec<&WriteTensor> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let header = header_bytes(&sorted, metadata)?;
    write_atomically(path, |out| {
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(&header)?;
        for tensor in &sorted {
            out.write_all(&tensor.data)?;
        }
        Ok(())
    })
}

fn invalid_input(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, message)
}

/// The padded header for tensors already sorted by name.
fn header_bytes(
    sorted: &[&WriteTensor],
    metadata: &BTreeMap<String, String>,
) -> io::Result<Vec<u8>> {
    // Keys are inserted in sorted order so the output is sorted whether serde_json's map is a
    // BTreeMap or (with the `preserve_order` feature some other crate may enable) insertion
    // ordered.
    let mut entries: BTreeMap<&str, Value> = BTreeMap::new();
    if !metadata.is_empty() {
        let map: Map<String, Value> = metadata
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        entries.insert(METADATA_KEY, Value::Object(map));
    }
    let mut offset = 0u64;
    for tensor in sorted {
        if tensor.name == METADATA_KEY {
            return Err(invalid_input(format!(
                "tensor name {METADATA_KEY:?} is reserved"
            )));
        }
        let expected = tensor
            .shape
            .iter()
            .try_fold(tensor.dtype.size_bytes(), |n, &d| n.checked_mul(d));
        if expected != Some(tensor.data.len()) {
            return Err(invalid_input(format!(
                "tensor {:?}: {} {:?} needs {expected:?} bytes, got {}",
                tensor.name,
                tensor.dtype,
                tensor.shape,
                tensor.data.len()
            )));
        }
        let end = offset + tensor.data.len() as u64;
        let mut fields = Map::new();
        fields.insert("data_offsets".to_owned(), Value::from(vec![offset, end]));
        fields.insert("dtype".to_owned(), Value::from(tensor.dtype.name()));
        fields.insert("shape".to_owned(), Value::from(tensor.shape.clone()));
        if entries
            .insert(&tensor.name, Value::Object(fields))
            .is_some()
        {
            return Err(invalid_input(format!(
                "tensor name {:?} appears twice",
                tensor.name
            )));
        }
        offset = end;
    }
    let root: Map<String, Value> = entries
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    let mut header = serde_json::to_vec(&Value::Object(root)).map_err(io::Error::other)?;
    header.resize(header.len().next_multiple_of(8), b' ');
    Ok(header)
}

/// Distinguishes temporary files of concurrent writes from one process.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

fn write_atomically(
    path: &Path,
    fill: impl FnOnce(&mut BufWriter<File>) -> io::Result<()>,
) -> io::Result<()> {
    let file_name = path
        .file_name()
        .ok_or_else(|| invalid_input(format!("{} has no file name", path.display())))?;
    let dir = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let temp = dir.join(format!(
        ".{}.tmp-{}-{}",
        file_name.to_string_lossy(),
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)?;
        let mut out = BufWriter::new(file);
        fill(&mut out)?;
        let file = out.into_inner().map_err(io::IntoInnerError::into_error)?;
        // Durable before the rename, so a crash cannot leave a renamed-but-empty checkpoint.
        file.sync_all()?;
        fs::rename(&temp, path)
    })();
    if result.is_err() {
        // Best effort: the original error matters more than a failed cleanup.
        let _ = fs::remove_file(&temp);
    }
    result
}
