//! Where each layer's state lives inside a page and inside a request's state slot. A page
//! holds `page_size` consecutive tokens' rows for every layer: sliding-window K=V rows, and for
//! compressed layers the compressed rows whose windows close inside the page (CSA rows and the
//! indexer's keys, one per 4 tokens; HCA rows, one per 128 tokens — with pages smaller than 128
//! tokens a page has one HCA slot, used when a window closes in it). The per-request slot holds
//! the compressors' unfinished windows and the previous window's overlap slice. The layout is
//! exported as the wire descriptor both sides of a transfer compare.

use crate::config::{Attention, ModelConfig};

/// Alignment of every region and of page and slot sizes, bytes.
pub const ALIGN: usize = 64;

/// What a region stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RegionKind {
    WindowKv,
    CsaKv,
    IndexerKeys,
    HcaKv,
    CompressorState,
    IndexerCompressorState,
}

/// Paged (rows indexed by position) or per request (the slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Paged,
    PerRequest,
}

/// How a row's values are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowFormat {
    /// Little-endian f32 values.
    F32,
    /// DeepSeek's FP8 K=V row: the leading `nope` dims as e4m3 with one ue8m0 scale per 64,
    /// the trailing rope dims as bf16; bytes = nope + 2*rope + scales padded to 8.
    Fp8Kv { nope: usize, rope: usize },
    /// Little-endian bf16 values (rounded to nearest even; a NaN stays a NaN): half the bytes
    /// of f32, the rounding of the FP8 row's rope dims applied to every value.
    Bf16,
}

impl RowFormat {
    /// How the K=V rows of a model configured by `c` are stored under `kv`.
    pub fn for_kv(c: &ModelConfig, kv: KvStorage) -> Self {
        match kv {
            KvStorage::F32 => RowFormat::F32,
            // DeepSeek's models have nope = 448 = 7 full blocks; smaller test models end with a
            // partial block, which gets its own scale like a full one.
            KvStorage::Fp8 => RowFormat::Fp8Kv {
                nope: c.head_dim - c.rope_dim,
                rope: c.rope_dim,
            },
            KvStorage::Bf16 => RowFormat::Bf16,
        }
    }

    /// A row of `elements` values in this format as the FP8 row's two parts: `nope` e4m3
    /// values (a ue8m0 scale per 64) then `rope` bf16 values. A bf16 row is the case of no e4m3
    /// values, byte for byte (no scales, no padding), so one encoder and one decoder, on the
    /// host and on the device, serve both. None for f32 rows.
    pub fn e4m3_bf16_split(self, elements: usize) -> Option<(usize, usize)> {
        match self {
            RowFormat::F32 => None,
            RowFormat::Fp8Kv { nope, rope } => Some((nope, rope)),
            RowFormat::Bf16 => Some((0, elements)),
        }
    }

    /// Bytes of one row of `elements` values.
    pub fn row_bytes(self, elements: usize) -> usize {
        match self {
            RowFormat::F32 => 4 * elements,
            RowFormat::Fp8Kv { nope, rope } => {
                nope + 2 * rope + nope.div_ceil(64).next_multiple_of(8)
            }
            RowFormat::Bf16 => 2 * elements,
        }
    }
}

/// Storage of the attention K=V rows (window, CSA and HCA rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvStorage {
    F32,
    /// DeepSeek's per-token FP8 format (lossy; its drift is measured by `pdctl bench-kv`).
    Fp8,
    /// bf16 values (lossy, half of f32; a relative error of at most 2^-9 per value).
    Bf16,
}

impl KvStorage {
    /// Every storage, the exact one first.
    pub const ALL: [KvStorage; 3] = [KvStorage::F32, KvStorage::Fp8, KvStorage::Bf16];

    /// The name settings and reports use (`kv_cache_dtype`).
    pub fn name(self) -> &'static str {
        match self {
            KvStorage::F32 => "f32",
            KvStorage::Fp8 => "fp8",
            KvStorage::Bf16 => "bf16",
        }
    }

    /// The storage named `name` (see [`Self::name`]).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// One region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    pub layer: usize,
    pub kind: RegionKind,
    pub placement: Placement,
    pub format: RowFormat,
    /// Logical elements per row.
    pub row_shape: Vec<usize>,
    pub rows: usize,
    pub row_stride: usize,
    pub offset: usize,
}

impl Region {
    pub fn elements(&self) -> usize {
        self.row_shape.iter().product()
    }

    /// Byte range of row `i` within its page or slot.
    pub fn row_range(&self, i: usize) -> std::ops::Range<usize> {
        let start = self.offset + i * self.row_stride;
        start..start + self.format.row_bytes(self.elements())
    }
}

/// Why a layout cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("page_size {0} must be a power of two between 4 and 4096")]
    PageSize(usize),
}

/// The complete layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateLayout {
    pub page_size: usize,
    pub page_bytes: usize,
    pub slot_bytes: usize,
    pub kv: KvStorage,
    pub fingerprint: String,
    /// Sorted by (layer, kind).
    pub regions: Vec<Region>,
}

impl StateLayout {
    pub fn new(
        c: &ModelConfig,
        page_size: usize,
        kv: KvStorage,
        fingerprint: &str,
    ) -> Result<Self, LayoutError> {
        if !page_size.is_power_of_two() || !(4..=4096).contains(&page_size) {
            return Err(LayoutError::PageSize(page_size));
        }
        let kv_format = RowFormat::for_kv(c, kv);
        let mut regions = Vec::new();
        let (mut page_at, mut slot_at) = (0usize, 0usize);
        let mut add =
            |layer, kind, placement, format: RowFormat, shape: Vec<usize>, rows: usize| {
                let elements: usize = shape.iter().product();
                let row_stride = format.row_bytes(elements);
                let at = match placement {
                    Placement::Paged => &mut page_at,
                    Placement::PerRequest => &mut slot_at,
                };
                regions.push(Region {
                    layer,
                    kind,
                    placement,
                    format,
                    row_shape: shape,
                    rows,
                    row_stride,
                    offset: *at,
                });
                *at = (*at + rows * row_stride).next_multiple_of(ALIGN);
            };
        for (layer, spec) in c.layers.iter().enumerate() {
            add(
                layer,
                RegionKind::WindowKv,
                Placement::Paged,
                kv_format,
                vec![c.head_dim],
                page_size,
            );
            match spec.attention {
                Attention::Sliding => {}
                Attention::Csa { ratio } => {
                    let rows = (page_size / ratio).max(1);
                    add(
                        layer,
                        RegionKind::CsaKv,
                        Placement::Paged,
                        kv_format,
                        vec![c.head_dim],
                        rows,
                    );
                    add(
                        layer,
                        RegionKind::IndexerKeys,
                        Placement::Paged,
                        RowFormat::F32,
                        vec![c.index_head_dim],
                        rows,
                    );
                    // Pending tokens (ratio) then the previous window's Ca slice (ratio), each
                    // row holding kv then gate scores of the full projected width.
                    add(
                        layer,
                        RegionKind::CompressorState,
                        Placement::PerRequest,
                        RowFormat::F32,
                        vec![2, 2 * c.head_dim],
                        2 * ratio,
                    );
                    add(
                        layer,
                        RegionKind::IndexerCompressorState,
                        Placement::PerRequest,
                        RowFormat::F32,
                        vec![2, 2 * c.index_head_dim],
                        2 * ratio,
                    );
                }
                Attention::Hca { ratio } => {
                    let rows = (page_size / ratio).max(1);
                    add(
                        layer,
                        RegionKind::HcaKv,
                        Placement::Paged,
                        kv_format,
                        vec![c.head_dim],
                        rows,
                    );
                    add(
                        layer,
                        RegionKind::CompressorState,
                        Placement::PerRequest,
                        RowFormat::F32,
                        vec![2, c.head_dim],
                        ratio,
                    );
                }
            }
        }
        Ok(Self {
            page_size,
            page_bytes: page_at.max(ALIGN),
            slot_bytes: slot_at.max(ALIGN),
            kv,
            fingerprint: fingerprint.to_owned(),
            regions,
        })
    }

    /// The region of `layer` and `kind`, if the layer has one.
    pub fn region(&self, layer: usize, kind: RegionKind) -> Option<&Region> {
        self.regions
            .iter()
            .find(|r| r.layer == layer && r.kind == kind)
    }

    /// The bytes of every page that hold `layer`'s rows (its paged regions are adjacent:
    /// regions are sorted by layer), or `None` for a layer without paged state.
    pub fn layer_page_bytes(&self, layer: usize) -> Option<std::ops::Range<usize>> {
        let mut paged = self
            .regions
            .iter()
            .filter(|r| r.layer == layer && r.placement == Placement::Paged);
        let first = paged.next()?;
        let start = first.offset;
        let end = std::iter::once(first)
            .chain(paged)
            .map(|r| r.offset + r.rows * r.row_stride)
            .max()
            .unwrap_or(start);
        Some(start..end)
    }

    /// Bytes of state per token for each paged region kind (summed over layers), and the slot.
    pub fn bytes_per_token(&self) -> Vec<(RegionKind, f64)> {
        let mut out: Vec<(RegionKind, f64)> = Vec::new();
        for r in self
            .regions
            .iter()
            .filter(|r| r.placement == Placement::Paged)
        {
            let bytes = (r.rows * r.row_stride) as f64 / self.page_size as f64;
            match out.iter_mut().find(|(k, _)| *k == r.kind) {
                Some((_, b)) => *b += bytes,
                None => out.push((r.kind, bytes)),
            }
        }
        out
    }

    /// The wire descriptor.
    pub fn to_proto(&self) -> proto::v1::StateLayout {
        use proto::v1;
        let regions = self
            .regions
            .iter()
            .map(|r| v1::Region {
                layer: r.layer as u32,
                kind: match r.kind {
                    RegionKind::WindowKv => v1::RegionKind::WindowKv,
                    RegionKind::CsaKv => v1::RegionKind::CsaKv,
                    RegionKind::IndexerKeys => v1::RegionKind::IndexerKeys,
                    RegionKind::HcaKv => v1::RegionKind::HcaKv,
                    RegionKind::CompressorState => v1::RegionKind::CompressorState,
                    RegionKind::IndexerCompressorState => v1::RegionKind::IndexerCompressorState,
                }
                .into(),
                placement: match r.placement {
                    Placement::Paged => v1::Placement::Paged,
                    Placement::PerRequest => v1::Placement::PerRequest,
                }
                .into(),
                dtype: match r.format {
                    RowFormat::F32 => v1::Dtype::F32,
                    RowFormat::Fp8Kv { .. } => v1::Dtype::U8,
                    RowFormat::Bf16 => v1::Dtype::Bf16,
                }
                .into(),
                row_shape: match r.format {
                    RowFormat::F32 | RowFormat::Bf16 => {
                        r.row_shape.iter().map(|&d| d as u64).collect()
                    }
                    RowFormat::Fp8Kv { .. } => vec![r.format.row_bytes(r.elements()) as u64],
                },
                rows: r.rows as u64,
                row_stride_bytes: r.row_stride as u64,
                offset_bytes: r.offset as u64,
            })
            .collect();
        v1::StateLayout {
            protocol_version: proto::PROTOCOL_VERSION.into(),
            model_fingerprint: self.fingerprint.clone(),
            page_size_tokens: self.page_size as u32,
            page_bytes: self.page_bytes as u64,
            slot_bytes: self.slot_bytes as u64,
            page_alignment_bytes: ALIGN as u64,
            regions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{config::ExpertFormat, synth::Preset};

    #[test]
    fn deepseek_fp8_row_is_584_bytes() {
        let f = RowFormat::Fp8Kv {
            nope: 448,
            rope: 64,
        };
        assert_eq!(f.row_bytes(512), 584);
    }

    #[test]
    fn layout_is_well_formed_on_the_wire() {
        let c = Preset::Tiny.config(ExpertFormat::Bf16);
        for page_size in [4, 16, 64, 128, 256] {
            let layout = StateLayout::new(&c, page_size, KvStorage::F32, "fp").unwrap();
            let wire = layout.to_proto();
            assert_eq!(proto::layout::problems(&wire), Vec::<String>::new());
            assert_eq!(wire.page_bytes % ALIGN as u64, 0);
        }
        assert!(StateLayout::new(&c, 48, KvStorage::F32, "fp").is_err());
        for kv in KvStorage::ALL {
            let layout = StateLayout::new(&c, 64, kv, "fp").unwrap();
            assert_eq!(
                proto::layout::problems(&layout.to_proto()),
                Vec::<String>::new()
            );
            assert_eq!(KvStorage::from_name(kv.name()), Some(kv));
        }
    }

    /// bf16 K=V rows are described as bf16 values of the row's shape and take half the bytes
    /// of f32 rows; the other regions are unchanged; layouts of different row storage do not
    /// pair.
    #[test]
    fn bf16_rows_on_the_wire() {
        let c = Preset::Tiny.config(ExpertFormat::Bf16);
        let f32 = StateLayout::new(&c, 16, KvStorage::F32, "fp").unwrap();
        let bf16 = StateLayout::new(&c, 16, KvStorage::Bf16, "fp").unwrap();
        let wire = bf16.to_proto();
        let mut kv_regions = 0;
        for ((a, b), w) in f32.regions.iter().zip(&bf16.regions).zip(&wire.regions) {
            assert_eq!((a.layer, a.kind, a.rows), (b.layer, b.kind, b.rows));
            let kv = matches!(
                a.kind,
                RegionKind::WindowKv | RegionKind::CsaKv | RegionKind::HcaKv
            );
            if kv {
                kv_regions += 1;
                assert_eq!(b.format, RowFormat::Bf16);
                assert_eq!(b.format.row_bytes(b.elements()), 2 * c.head_dim);
                assert_eq!(w.dtype, i32::from(proto::v1::Dtype::Bf16));
                assert_eq!(w.row_shape, vec![c.head_dim as u64]);
            } else {
                assert_eq!(a.format, b.format);
                assert_eq!(a.row_stride, b.row_stride);
            }
        }
        assert!(kv_regions >= c.num_layers());
        assert!(bf16.page_bytes < f32.page_bytes);
        assert!(proto::layout::check_compatible(&f32.to_proto(), &wire).is_err());
    }

    #[test]
    fn different_page_sizes_do_not_pair() {
        let c = Preset::Tiny.config(ExpertFormat::Bf16);
        let a = StateLayout::new(&c, 64, KvStorage::F32, "fp")
            .unwrap()
            .to_proto();
        let b = StateLayout::new(&c, 32, KvStorage::F32, "fp")
            .unwrap()
            .to_proto();
        assert!(proto::layout::check_compatible(&a, &b).is_err());
    }
}
