//! Comparing and checking state layouts. Two workers pair only when their layouts are equal;
//! when they are not, the error lists every difference so an operator can see what to fix.

use std::fmt;

use crate::v1::{Dtype, Placement, ProtocolVersion, Region, RegionKind, StateLayout};

/// Two layouts that must not be paired, with every difference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct LayoutMismatch {
    /// One entry per differing field, `field: ours vs theirs`.
    pub differences: Vec<String>,
}

impl fmt::Display for LayoutMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "state layouts differ: {}", self.differences.join("; "))
    }
}

/// Ok when `ours` and `theirs` describe the same bytes; otherwise every difference.
pub fn check_compatible(ours: &StateLayout, theirs: &StateLayout) -> Result<(), LayoutMismatch> {
    let differences = differences(ours, theirs);
    if differences.is_empty() {
        Ok(())
    } else {
        Err(LayoutMismatch { differences })
    }
}

/// Lists the differences between two layouts (empty when equal).
pub fn differences(ours: &StateLayout, theirs: &StateLayout) -> Vec<String> {
    let mut out = Vec::new();
    let mut field = |name: &str, a: String, b: String| {
        if a != b {
            out.push(format!("{name}: ours {a} vs theirs {b}"));
        }
    };
    field(
        "protocol_version",
        version_name(ours.protocol_version),
        version_name(theirs.protocol_version),
    );
    field(
        "model_fingerprint",
        ours.model_fingerprint.clone(),
        theirs.model_fingerprint.clone(),
    );
    field(
        "page_size_tokens",
        ours.page_size_tokens.to_string(),
        theirs.page_size_tokens.to_string(),
    );
    field(
        "page_bytes",
        ours.page_bytes.to_string(),
        theirs.page_bytes.to_string(),
    );
    field(
        "slot_bytes",
        ours.slot_bytes.to_string(),
        theirs.slot_bytes.to_string(),
    );
    field(
        "page_alignment_bytes",
        ours.page_alignment_bytes.to_string(),
        theirs.page_alignment_bytes.to_string(),
    );
    field(
        "regions.len",
        ours.regions.len().to_string(),
        theirs.regions.len().to_string(),
    );
    for (i, (a, b)) in ours.regions.iter().zip(&theirs.regions).enumerate() {
        if a != b {
            out.push(format!(
                "regions[{i}]: ours {} vs theirs {}",
                describe_region(a),
                describe_region(b)
            ));
        }
    }
    out
}

/// Structural problems of a single layout (a worker checks its own before serving).
pub fn problems(layout: &StateLayout) -> Vec<String> {
    let mut out = Vec::new();
    if layout.protocol_version != i32::from(ProtocolVersion::V1) {
        out.push(format!(
            "protocol_version is {}, expected V1",
            version_name(layout.protocol_version)
        ));
    }
    if layout.model_fingerprint.is_empty() {
        out.push("model_fingerprint is empty".to_owned());
    }
    if layout.page_size_tokens == 0 {
        out.push("page_size_tokens is 0".to_owned());
    }
    let align = layout.page_alignment_bytes;
    if align == 0 || !align.is_power_of_two() {
        out.push(format!(
            "page_alignment_bytes {align} is not a power of two"
        ));
    }
    for (i, region) in layout.regions.iter().enumerate() {
        let bytes = region_bytes(region);
        let capacity = match Placement::try_from(region.placement) {
            Ok(Placement::Paged) => layout.page_bytes,
            Ok(Placement::PerRequest) => layout.slot_bytes,
            _ => {
                out.push(format!("regions[{i}]: placement unspecified"));
                continue;
            }
        };
        if matches!(
            Dtype::try_from(region.dtype),
            Ok(Dtype::Unspecified) | Err(_)
        ) {
            out.push(format!("regions[{i}]: dtype unspecified"));
        }
        if matches!(
            RegionKind::try_from(region.kind),
            Ok(RegionKind::Unspecified) | Err(_)
        ) {
            out.push(format!("regions[{i}]: kind unspecified"));
        }
        match bytes {
            Some(end)
                if region
                    .offset_bytes
                    .checked_add(end)
                    .is_some_and(|e| e <= capacity) => {}
            _ => out.push(format!(
                "regions[{i}] ({}) does not fit in {capacity} bytes",
                describe_region(region)
            )),
        }
        if row_bytes(region).is_some_and(|row| region.row_stride_bytes < row) {
            out.push(format!("regions[{i}]: row_stride_bytes smaller than a row"));
        }
    }
    let mut sorted = layout.regions.clone();
    sorted.sort_by_key(|r| (r.layer, r.kind));
    if sorted != layout.regions {
        out.push("regions are not sorted by (layer, kind)".to_owned());
    }
    out
}

/// Bytes of one element of `dtype`, as (numerator, denominator) to cover packed 4-bit types.
pub fn dtype_size(dtype: Dtype) -> Option<(u64, u64)> {
    match dtype {
        Dtype::F32 => Some((4, 1)),
        Dtype::Bf16 | Dtype::F16 => Some((2, 1)),
        Dtype::F8E4m3 | Dtype::Ue8m0 | Dtype::U8 => Some((1, 1)),
        Dtype::E2m1x2 => Some((1, 2)),
        Dtype::Unspecified => None,
    }
}

/// Bytes of one row, rounded up to whole bytes.
pub fn row_bytes(region: &Region) -> Option<u64> {
    let (num, den) = dtype_size(Dtype::try_from(region.dtype).ok()?)?;
    let elements = region
        .row_shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))?;
    Some(elements.checked_mul(num)?.div_ceil(den))
}

/// Bytes a region spans: `rows` rows at `row_stride_bytes` (the last row unpadded).
pub fn region_bytes(region: &Region) -> Option<u64> {
    if region.rows == 0 {
        return Some(0);
    }
    let row = row_bytes(region)?;
    (region.rows - 1)
        .checked_mul(region.row_stride_bytes)?
        .checked_add(row)
}

fn version_name(v: i32) -> String {
    ProtocolVersion::try_from(v).map_or_else(|_| format!("unknown({v})"), |p| format!("{p:?}"))
}

fn describe_region(r: &Region) -> String {
    let kind = RegionKind::try_from(r.kind)
        .map_or_else(|_| format!("kind {}", r.kind), |k| format!("{k:?}"));
    let dtype = Dtype::try_from(r.dtype)
        .map_or_else(|_| format!("dtype {}", r.dtype), |d| format!("{d:?}"));
    format!(
        "layer {} {kind} {dtype} {:?}x{} stride {} at {}",
        r.layer, r.row_shape, r.rows, r.row_stride_bytes, r.offset_bytes
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> StateLayout {
        let window = Region {
            layer: 0,
            kind: RegionKind::WindowKv.into(),
            placement: Placement::Paged.into(),
            dtype: Dtype::F32.into(),
            row_shape: vec![512],
            rows: 64,
            row_stride_bytes: 2048,
            offset_bytes: 0,
        };
        let csa = Region {
            layer: 1,
            kind: RegionKind::CsaKv.into(),
            rows: 16,
            offset_bytes: 64 * 2048,
            ..window.clone()
        };
        let state = Region {
            layer: 1,
            kind: RegionKind::CompressorState.into(),
            placement: Placement::PerRequest.into(),
            row_shape: vec![2, 8, 512],
            rows: 1,
            row_stride_bytes: 2 * 8 * 512 * 4,
            offset_bytes: 0,
            ..window.clone()
        };
        StateLayout {
            protocol_version: ProtocolVersion::V1.into(),
            model_fingerprint: "ab12".into(),
            page_size_tokens: 64,
            page_bytes: 80 * 2048,
            slot_bytes: 2 * 8 * 512 * 4,
            page_alignment_bytes: 4096,
            regions: vec![window, csa, state],
        }
    }

    #[test]
    fn sample_is_well_formed() {
        assert_eq!(problems(&sample()), Vec::<String>::new());
    }

    #[test]
    fn equal_layouts_pair() {
        assert_eq!(sample(), sample());
        assert!(check_compatible(&sample(), &sample()).is_ok());
    }

    #[test]
    fn every_field_difference_is_reported() {
        type Mutation = fn(&mut StateLayout);
        let cases: [(&str, Mutation); 8] = [
            ("protocol_version", |l| l.protocol_version = 0),
            ("model_fingerprint", |l| l.model_fingerprint = "cd34".into()),
            ("page_size_tokens", |l| l.page_size_tokens = 128),
            ("page_bytes", |l| l.page_bytes += 1),
            ("slot_bytes", |l| l.slot_bytes += 1),
            ("page_alignment_bytes", |l| l.page_alignment_bytes = 64),
            ("regions[1]", |l| l.regions[1].dtype = Dtype::Bf16.into()),
            ("regions.len", |l| {
                l.regions.pop();
            }),
        ];
        for (name, mutate) in cases {
            let mut theirs = sample();
            mutate(&mut theirs);
            assert_ne!(sample(), theirs, "{name}");
            let err = check_compatible(&sample(), &theirs).unwrap_err();
            assert!(
                err.differences.iter().any(|d| d.starts_with(name)),
                "{name}: {err}"
            );
            assert!(err.to_string().starts_with("state layouts differ: "));
        }
    }

    #[test]
    fn all_differences_listed_at_once() {
        let mut theirs = sample();
        theirs.page_size_tokens = 32;
        theirs.model_fingerprint = "other".into();
        let err = check_compatible(&sample(), &theirs).unwrap_err();
        assert_eq!(err.differences.len(), 2, "{err}");
    }

    #[test]
    fn structural_problems_are_found() {
        let mut bad = sample();
        bad.regions[0].rows = 1000;
        bad.regions[2].row_stride_bytes = 8;
        bad.regions.swap(0, 1);
        bad.page_alignment_bytes = 3;
        let found = problems(&bad);
        assert!(
            found.iter().any(|p| p.contains("does not fit")),
            "{found:?}"
        );
        assert!(
            found.iter().any(|p| p.contains("row_stride_bytes")),
            "{found:?}"
        );
        assert!(found.iter().any(|p| p.contains("not sorted")), "{found:?}");
        assert!(
            found.iter().any(|p| p.contains("power of two")),
            "{found:?}"
        );
    }

    #[test]
    fn packed_rows_round_up() {
        let mut r = sample().regions[0].clone();
        r.dtype = Dtype::E2m1x2.into();
        r.row_shape = vec![3];
        assert_eq!(row_bytes(&r), Some(2));
    }
}
