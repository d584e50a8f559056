//! Reader/writer tests for `engine::safetensors`: round trips, a byte-exact golden file, every
//! validation error produced from crafted bytes, and fuzzing that `open` never panics.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use engine::safetensors::{
    Dtype, MAX_HEADER_LEN, SafetensorsError, SafetensorsFile, TensorView, WriteTensor, write,
};
use proptest::prelude::*;
use tempfile::TempDir;

fn tensor(name: &str, dtype: Dtype, shape: &[usize], data: Vec<u8>) -> WriteTensor {
    WriteTensor {
        name: name.to_owned(),
        dtype,
        shape: shape.to_vec(),
        data,
    }
}

fn f32_bytes(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A file image built by hand: header length, header text, data section.
fn image(header: &str, data: &[u8]) -> Vec<u8> {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    bytes
}

/// Each call gets its own file so no earlier mapping ever sees its file rewritten.
fn unique_path(dir: &TempDir) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    dir.path().join(format!(
        "f{}.safetensors",
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

fn open_bytes(dir: &TempDir, bytes: &[u8]) -> Result<SafetensorsFile, SafetensorsError> {
    let path = unique_path(dir);
    std::fs::write(&path, bytes).unwrap();
    SafetensorsFile::open(&path)
}

fn open_image(header: &str, data: &[u8]) -> SafetensorsError {
    let dir = TempDir::new().unwrap();
    open_bytes(&dir, &image(header, data)).unwrap_err()
}

/// Two F32[2] tensors "a" and "b" with the given offsets.
fn two_tensors(a: [u64; 2], b: [u64; 2]) -> String {
    format!(
        r#"{{"a":{{"dtype":"F32","shape":[2],"data_offsets":[{},{}]}},"b":{{"dtype":"F32","shape":[2],"data_offsets":[{},{}]}}}}"#,
        a[0], a[1], b[0], b[1]
    )
}

#[test]
fn round_trip_several_dtypes() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("model.safetensors");
    let tensors = vec![
        tensor(
            "w.f32",
            Dtype::F32,
            &[2, 2],
            f32_bytes(&[1.0, -2.0, 0.5, 3.25]),
        ),
        tensor(
            "w.bf16",
            Dtype::BF16,
            &[3],
            vec![0x80, 0x3F, 0x00, 0xC0, 0, 0],
        ),
        tensor("w.f16", Dtype::F16, &[2], vec![0x00, 0x3C, 0x00, 0xC0]),
        tensor(
            "w.fp8",
            Dtype::F8E4M3,
            &[2, 3],
            vec![0x38, 0x7E, 0, 1, 2, 3],
        ),
        tensor("w.scale", Dtype::F8E8M0, &[1, 1], vec![0x7F]),
        tensor(
            "ids",
            Dtype::I64,
            &[2],
            [7i64, -1].iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
        tensor("mask", Dtype::Bool, &[3], vec![1, 0, 1]),
        tensor("packed", Dtype::U8, &[1, 4], vec![0x71, 0x9A, 0, 0xFF]),
        tensor("empty", Dtype::F32, &[0, 4], vec![]),
        tensor("scalar", Dtype::F64, &[], 2.5f64.to_le_bytes().to_vec()),
    ];
    let metadata = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
    write(&path, &tensors, &metadata).unwrap();

    let file = SafetensorsFile::open(&path).unwrap();
    assert_eq!(file.path(), path.as_path());
    assert_eq!(file.metadata(), &metadata);
    assert_eq!(file.len(), tensors.len());
    let mut expected_names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    expected_names.sort_unstable();
    assert_eq!(file.names().collect::<Vec<_>>(), expected_names);
    for t in &tensors {
        let view = file.get(&t.name).unwrap();
        assert_eq!(view.dtype, t.dtype, "{}", t.name);
        assert_eq!(view.shape, t.shape.as_slice(), "{}", t.name);
        assert_eq!(view.data, t.data.as_slice(), "{}", t.name);
    }
    let floats = |name| file.get(name).unwrap().to_f32_vec();
    assert_eq!(floats("w.f32"), Some(vec![1.0, -2.0, 0.5, 3.25]));
    assert_eq!(floats("w.bf16"), Some(vec![1.0, -2.0, 0.0]));
    assert_eq!(floats("w.f16"), Some(vec![1.0, -2.0]));
    assert_eq!(floats("empty"), Some(vec![]));
    assert_eq!(floats("ids"), None, "integers are not widened");
    assert_eq!(file.get("scalar").unwrap().numel(), 1);
    assert_eq!(file.get("empty").unwrap().numel(), 0);
    assert!(file.get("missing").is_none());
}

#[test]
fn golden_tiny_file() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("tiny.safetensors");
    let x = tensor("x", Dtype::F32, &[2], f32_bytes(&[1.0, 2.0]));
    write(&path, &[x], &BTreeMap::new()).unwrap();
    let header = r#"{"x":{"data_offsets":[0,8],"dtype":"F32","shape":[2]}}"#;
    assert_eq!(header.len(), 54);
    let mut expected = vec![56, 0, 0, 0, 0, 0, 0, 0];
    expected.extend_from_slice(header.as_bytes());
    expected.extend_from_slice(b"  "); // padded to 56, a multiple of 8
    expected.extend_from_slice(&[0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0x40]);
    assert_eq!(std::fs::read(&path).unwrap(), expected);
}

#[test]
fn output_is_deterministic_and_sorted() {
    let dir = TempDir::new().unwrap();
    let a = tensor("z", Dtype::U8, &[1], vec![1]);
    let b = tensor("Z", Dtype::U8, &[2], vec![2, 3]);
    let metadata = BTreeMap::from([
        ("b".to_owned(), "2".to_owned()),
        ("a".to_owned(), "1".to_owned()),
    ]);
    let first = dir.path().join("first.safetensors");
    let second = dir.path().join("second.safetensors");
    write(&first, &[a.clone(), b.clone()], &metadata).unwrap();
    write(&second, &[b, a], &metadata).unwrap();
    let bytes = std::fs::read(&first).unwrap();
    assert_eq!(bytes, std::fs::read(&second).unwrap());
    // Byte-wise key order: "Z" < "__metadata__" < "z"; data follows the tensor order.
    let header = concat!(
        r#"{"Z":{"data_offsets":[0,2],"dtype":"U8","shape":[2]},"#,
        r#""__metadata__":{"a":"1","b":"2"},"#,
        r#""z":{"data_offsets":[2,3],"dtype":"U8","shape":[1]}}"#
    );
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!(n % 8, 0);
    assert_eq!(
        std::str::from_utf8(&bytes[8..8 + n]).unwrap().trim_end(),
        header
    );
    assert_eq!(&bytes[8 + n..], &[2, 3, 1]);
    // Rewriting in place replaces the file and leaves no temporary files behind.
    write(&first, &[], &BTreeMap::new()).unwrap();
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    let empty = SafetensorsFile::open(&first).unwrap();
    assert!(empty.is_empty());
    assert_eq!(std::fs::read(&first).unwrap(), image("{}      ", &[]));
}

#[test]
fn writer_rejects_bad_input() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("bad.safetensors");
    let none = BTreeMap::new();
    let cases = [
        vec![
            tensor("a", Dtype::U8, &[1], vec![1]),
            tensor("a", Dtype::U8, &[1], vec![2]),
        ],
        vec![tensor("a", Dtype::F32, &[2], vec![0; 7])],
        vec![tensor("__metadata__", Dtype::U8, &[1], vec![1])],
        vec![tensor("a", Dtype::U8, &[usize::MAX, 2], vec![])],
    ];
    for tensors in cases {
        let err = write(&path, &tensors, &none).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{err}");
        assert!(!path.exists());
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "no temp files left"
    );
}

#[test]
fn trailing_space_padding_is_accepted() {
    let dir = TempDir::new().unwrap();
    let header = format!(
        "{}{}",
        r#"{"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
        " ".repeat(13)
    );
    let file = open_bytes(&dir, &image(&header, &[4, 5])).unwrap();
    assert_eq!(file.get("x").unwrap().data, &[4, 5]);
}

#[test]
fn too_short_files() {
    let dir = TempDir::new().unwrap();
    for len in 0..8 {
        let err = open_bytes(&dir, &vec![0; len]).unwrap_err();
        assert!(
            matches!(err, SafetensorsError::TooShort { len: l, .. } if l == len as u64),
            "{err}"
        );
    }
}

#[test]
fn header_length_checks() {
    let dir = TempDir::new().unwrap();
    let mut huge = (MAX_HEADER_LEN + 1).to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    let err = open_bytes(&dir, &huge).unwrap_err();
    assert!(
        matches!(err, SafetensorsError::HeaderTooLarge { .. }),
        "{err}"
    );
    let mut beyond = 1000u64.to_le_bytes().to_vec();
    beyond.extend_from_slice(b"{}");
    let err = open_bytes(&dir, &beyond).unwrap_err();
    assert!(
        matches!(
            err,
            SafetensorsError::HeaderBeyondFile {
                header_len: 1000,
                file_len: 10,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn header_content_errors() {
    let dir = TempDir::new().unwrap();
    let mut not_utf8 = 2u64.to_le_bytes().to_vec();
    not_utf8.extend_from_slice(&[0xFF, 0xFE]);
    let err = open_bytes(&dir, &not_utf8).unwrap_err();
    assert!(
        matches!(err, SafetensorsError::HeaderNotUtf8 { .. }),
        "{err}"
    );
    let err = open_image(r#"{"x": "#, &[]);
    assert!(
        matches!(err, SafetensorsError::HeaderNotJson { .. }),
        "{err}"
    );
    let err = open_image("", &[]);
    assert!(
        matches!(err, SafetensorsError::HeaderNotJson { .. }),
        "{err}"
    );
    let err = open_image("[1,2]", &[]);
    assert!(
        matches!(err, SafetensorsError::HeaderNotObject { .. }),
        "{err}"
    );
    for metadata in [r#"{"__metadata__":{"a":1}}"#, r#"{"__metadata__":[]}"#] {
        let err = open_image(metadata, &[]);
        assert!(matches!(err, SafetensorsError::BadMetadata { .. }), "{err}");
    }
}

#[test]
fn entry_errors_name_the_tensor() {
    let err = open_image(
        r#"{"x":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}"#,
        &[0],
    );
    assert!(
        matches!(&err, SafetensorsError::UnknownDtype { tensor, dtype, .. } if tensor == "x" && dtype == "F4"),
        "{err}"
    );
    let malformed = [
        r#"{"x":[1]}"#,
        r#"{"x":{"shape":[1],"data_offsets":[0,1]}}"#,
        r#"{"x":{"dtype":7,"shape":[1],"data_offsets":[0,1]}}"#,
        r#"{"x":{"dtype":"U8","data_offsets":[0,1]}}"#,
        r#"{"x":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}}"#,
        r#"{"x":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}}"#,
        r#"{"x":{"dtype":"U8","shape":[1]}}"#,
        r#"{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}}"#,
        r#"{"x":{"dtype":"U8","shape":[1],"data_offsets":[0]}}"#,
        r#"{"x":{"dtype":"U8","shape":[1],"data_offsets":"0,1"}}"#,
    ];
    for header in malformed {
        let err = open_image(header, &[0]);
        assert!(
            matches!(&err, SafetensorsError::MalformedEntry { tensor, .. } if tensor == "x"),
            "{header}: {err}"
        );
    }
    let err = open_image(
        r#"{"x":{"dtype":"U8","shape":[1],"data_offsets":[4,3]}}"#,
        &[0; 4],
    );
    assert!(
        matches!(
            err,
            SafetensorsError::OffsetsReversed {
                begin: 4,
                end: 3,
                ..
            }
        ),
        "{err}"
    );
    let err = open_image(
        r#"{"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
        &[0; 8],
    );
    assert!(
        matches!(
            err,
            SafetensorsError::LengthMismatch {
                expected: 12,
                actual: 8,
                ..
            }
        ),
        "{err}"
    );
    let err = open_image(
        r#"{"x":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}}"#,
        &[0; 8],
    );
    assert!(
        matches!(err, SafetensorsError::ShapeOverflow { .. }),
        "{err}"
    );
}

#[test]
fn truncation_at_every_point_is_reported() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("full.safetensors");
    let tensors = [
        tensor("a", Dtype::F32, &[2], f32_bytes(&[1.0, 2.0])),
        tensor("b", Dtype::BF16, &[6], vec![1; 12]),
    ];
    write(&path, &tensors, &BTreeMap::new()).unwrap();
    let full = std::fs::read(&path).unwrap();
    let data_start = 8 + u64::from_le_bytes(full[..8].try_into().unwrap()) as usize;
    for cut in 0..full.len() {
        let err = open_bytes(&dir, &full[..cut]).unwrap_err();
        match err {
            SafetensorsError::TooShort { .. } => assert!(cut < 8),
            SafetensorsError::HeaderBeyondFile { .. } => assert!((8..data_start).contains(&cut)),
            SafetensorsError::Truncated { ref tensor, .. } => {
                let expected = if cut < data_start + 8 { "a" } else { "b" };
                assert_eq!(tensor, expected, "cut at {cut}");
                let message = err.to_string();
                assert!(
                    message.contains(".safetensors") && message.contains(&format!("{tensor:?}")),
                    "{message}"
                );
            }
            other => panic!("cut at {cut}: unexpected {other}"),
        }
    }
    assert!(open_bytes(&dir, &full).is_ok());
}

#[test]
fn overlaps_and_holes() {
    let err = open_image(&two_tensors([0, 8], [4, 12]), &[0; 12]);
    assert!(
        matches!(&err, SafetensorsError::Overlap { first, second, .. } if first == "a" && second == "b"),
        "{err}"
    );
    // Identical ranges are an overlap too.
    let err = open_image(&two_tensors([0, 8], [0, 8]), &[0; 8]);
    assert!(matches!(err, SafetensorsError::Overlap { .. }), "{err}");
    let err = open_image(&two_tensors([0, 8], [12, 20]), &[0; 20]);
    assert!(
        matches!(&err, SafetensorsError::Hole { begin: 8, end: 12, after: Some(a), before: Some(b), .. } if a == "a" && b == "b"),
        "{err}"
    );
    let err = open_image(&two_tensors([4, 12], [12, 20]), &[0; 20]);
    assert!(
        matches!(&err, SafetensorsError::Hole { begin: 0, end: 4, after: None, before: Some(b), .. } if b == "a"),
        "{err}"
    );
    let err = open_image(&two_tensors([0, 8], [8, 16]), &[0; 18]);
    assert!(
        matches!(&err, SafetensorsError::Hole { begin: 16, end: 18, after: Some(a), before: None, .. } if a == "b"),
        "{err}"
    );
    assert!(err.to_string().contains("16..18"), "{err}");
    // Bytes with no tensors at all are a hole as well.
    let err = open_image("{}", &[0; 3]);
    assert!(
        matches!(
            err,
            SafetensorsError::Hole {
                begin: 0,
                end: 3,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn errors_name_the_file() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("named.safetensors");
    std::fs::write(&path, image(&two_tensors([0, 8], [8, 16]), &[0; 9])).unwrap();
    let message = SafetensorsFile::open(&path).unwrap_err().to_string();
    assert!(
        message.contains("named.safetensors") && message.contains("\"b\""),
        "{message}"
    );
    let missing = dir.path().join("missing.safetensors");
    let err = SafetensorsFile::open(&missing).unwrap_err();
    assert!(matches!(err, SafetensorsError::Io { .. }));
    assert!(err.to_string().contains("missing.safetensors"), "{err}");
}

#[test]
fn view_conversions() {
    let bf16 = TensorView {
        dtype: Dtype::BF16,
        shape: &[2],
        data: &[0x80, 0x3F, 0x80, 0xBF],
    };
    assert_eq!(bf16.to_f32_vec(), Some(vec![1.0, -1.0]));
    let short = TensorView {
        dtype: Dtype::F32,
        shape: &[2],
        data: &[0; 7],
    };
    assert_eq!(short.to_f32_vec(), None, "inconsistent hand-built view");
    let huge = TensorView {
        dtype: Dtype::F32,
        shape: &[usize::MAX, 2],
        data: &[],
    };
    assert_eq!(huge.numel(), usize::MAX);
    assert_eq!(huge.to_f32_vec(), None);
    for dtype in Dtype::ALL {
        assert_eq!(Dtype::from_name(dtype.name()), Some(dtype));
    }
    assert_eq!(Dtype::from_name("f32"), None);
    assert_eq!(
        (
            Dtype::F8E4M3.size_bytes(),
            Dtype::BF16.size_bytes(),
            Dtype::F64.size_bytes()
        ),
        (1, 2, 8)
    );
}

/// A small valid file used as the seed for corruption fuzzing.
fn valid_file() -> Vec<u8> {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("seed.safetensors");
    let tensors = [
        tensor("a", Dtype::F32, &[2], f32_bytes(&[1.0, 2.0])),
        tensor("b", Dtype::F16, &[3], vec![0, 0x3C, 0, 0xC0, 0xFF, 0x7C]),
        tensor("c", Dtype::U8, &[0], vec![]),
    ];
    let metadata = BTreeMap::from([("k".to_owned(), "v".to_owned())]);
    write(&path, &tensors, &metadata).unwrap();
    std::fs::read(&path).unwrap()
}

/// Whatever `open` returns, using the result must not panic either.
fn exercise(dir: &TempDir, bytes: &[u8]) {
    if let Ok(file) = open_bytes(dir, bytes) {
        let names: Vec<String> = file.names().map(str::to_owned).collect();
        for name in names {
            let view = file.get(&name).unwrap();
            let _ = view.to_f32_vec();
            let _ = view.numel();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let dir = TempDir::new().unwrap();
        exercise(&dir, &bytes);
    }

    #[test]
    fn arbitrary_headers_never_panic(header in "[{}\\[\\]\":,0-9a-zA-Z_ .-]{0,120}", data in proptest::collection::vec(any::<u8>(), 0..32)) {
        let dir = TempDir::new().unwrap();
        exercise(&dir, &image(&header, &data));
    }

    #[test]
    fn corrupted_valid_files_never_panic(position in any::<prop::sample::Index>(), byte in any::<u8>(), truncate in any::<bool>()) {
        let dir = TempDir::new().unwrap();
        let mut bytes = valid_file();
        let at = position.index(bytes.len());
        if truncate {
            bytes.truncate(at);
        } else {
            bytes[at] = byte;
        }
        exercise(&dir, &bytes);
    }
}
