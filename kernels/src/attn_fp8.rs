//! Shapes and work plan of `attn_decode_fp8.cu`, decode attention with all heads of a request
//! against each tile of its FP8 rows on tensor cores: what the launch wrapper checks and sizes,
//! and what the emulation and the reference share with it.

/// Rows per tile (`TILE` in the kernel).
pub const TILE: usize = crate::cuda_constants::attn_decode_fp8::TILE;
/// Threads of `attn_fp8_partial`.
pub const THREADS: usize = crate::cuda_constants::attn_decode_fp8::THREADS;
/// The most heads a block computes (4 blocks of 16 heads).
pub const MAX_HEADS: usize = 64;
/// The widest row (16 output tiles of 8 per warp quarter).
pub const MAX_DIM: usize = 512;
/// Row offset of an empty slot: adds nothing (fixed-size index lists pad with it).
pub const EMPTY_SLOT: i64 = -1;

/// One launch's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8AttnShape {
    pub heads: usize,
    /// e4m3 values per row (one ue8m0 scale per 64).
    pub nope: usize,
    /// bf16 values per row, after the nope values.
    pub rope: usize,
    pub scale: f32,
    /// Work items beyond one per request the plan may make (the SM count, say): a long request
    /// is cut into about `total tiles / parts` tiles per item.
    pub parts: usize,
}

impl Fp8AttnShape {
    /// Values per row.
    pub fn dim(&self) -> usize {
        self.nope + self.rope
    }

    /// Bytes per stored row: nope bytes, 2 per rope value, scales padded to 8
    /// (`engine::paged::layout::RowFormat::Fp8Kv::row_bytes`).
    pub fn row_bytes(&self) -> usize {
        self.nope + 2 * self.rope + self.nope.div_ceil(64).next_multiple_of(8)
    }

    /// Heads padded to the MMA's 16 rows.
    pub fn padded_heads(&self) -> usize {
        self.heads.next_multiple_of(16)
    }

    /// Dims padded to 32 (each warp quarter a whole number of 8-wide tiles, each half of the
    /// scores a whole number of 16-deep steps).
    pub fn padded_dim(&self) -> usize {
        self.dim().next_multiple_of(32)
    }

    /// Work items the plan can make for `batch` requests: partial buffers are this many.
    pub fn capacity(&self, batch: usize) -> usize {
        batch + self.parts
    }

    /// Dynamic shared memory of `attn_fp8_partial` in bytes (the layout in the kernel file).
    pub fn smem_bytes(&self) -> usize {
        let (hp, ld) = (self.padded_heads(), self.padded_dim() + 8);
        2 * hp * ld
            + 2 * TILE * ld
            + 4 * 2 * hp * TILE
            + 2 * hp * (TILE + 8)
            + 4 * 3 * hp
            + 4 * TILE
    }

    /// Checks the shape: 1..=64 heads, 1..=512 values, whole 64-value scale blocks are not
    /// required (the last block may be partial, as in the engine's small models), at least one
    /// part, a finite scale.
    pub fn check(&self) -> Result<(), String> {
        if self.heads == 0
            || self.heads > MAX_HEADS
            || self.dim() == 0
            || self.dim() > MAX_DIM
            || self.parts == 0
            || self.parts > 1 << 16
            || !self.scale.is_finite()
        {
            return Err(format!(
                "attn_decode_fp8: heads {} (1..={MAX_HEADS}), nope {} + rope {} (1..={MAX_DIM} \
                 values), parts {} (1..=65536), scale {}",
                self.heads, self.nope, self.rope, self.parts, self.scale
            ));
        }
        Ok(())
    }
}

/// One work item: tiles `[lo, hi)` of request `request`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item {
    pub request: usize,
    pub lo: i64,
    pub hi: i64,
}

/// `attn_fp8_plan`: every request's tiles (an empty request has one empty tile) cut into runs of
/// `ceil(total / parts)`; returns the items and each request's first item (`batch + 1`
/// entries). At most `batch + parts` items.
pub fn plan(starts: &[i64], parts: usize) -> (Vec<Item>, Vec<usize>) {
    let batch = starts.len().saturating_sub(1);
    let tiles = |b: usize| ((starts[b + 1] - starts[b] + TILE as i64 - 1) / TILE as i64).max(1);
    let total: i64 = (0..batch).map(tiles).sum();
    let parts = parts as i64;
    let per_part = ((total + parts - 1) / parts).max(1);
    let mut items = Vec::new();
    let mut split_starts = Vec::with_capacity(batch + 1);
    for b in 0..batch {
        split_starts.push(items.len());
        let t = tiles(b);
        let mut lo = 0;
        while lo < t {
            items.push(Item {
                request: b,
                lo,
                hi: t.min(lo + per_part),
            });
            lo += per_part;
        }
    }
    split_starts.push(items.len());
    (items, split_starts)
}

/// Checks host-side inputs of a launch: `starts` (`batch + 1`, from 0, non-decreasing, ending at
/// the number of offsets), queries and sinks of the right length, and every row offset either
/// `-1`, another negative value (an undefined choice: the request's heads become NaN) or a
/// whole row inside a pool of `pool_bytes`.
pub fn check_inputs(
    shape: &Fp8AttnShape,
    q_len: usize,
    pool_bytes: usize,
    row_offsets: &[i64],
    starts: &[i64],
    sinks: usize,
) -> Result<usize, String> {
    shape.check()?;
    let batch = starts.len().saturating_sub(1);
    if starts.first().is_some_and(|&s| s != 0)
        || starts.windows(2).any(|w| w[1] < w[0])
        || starts.last().map_or(0, |&s| s as usize) != row_offsets.len()
    {
        return Err("attn_decode_fp8: starts must rise from 0 to the number of offsets".into());
    }
    if q_len != batch * shape.heads * shape.dim() || sinks != shape.heads {
        return Err(format!(
            "attn_decode_fp8: {q_len} query values and {sinks} sinks for {batch} requests of {} \
             heads of {}",
            shape.heads,
            shape.dim()
        ));
    }
    let row = shape.row_bytes() as i64;
    if let Some(bad) = row_offsets
        .iter()
        .find(|&&o| o >= 0 && o.checked_add(row).is_none_or(|end| end > pool_bytes as i64))
    {
        return Err(format!(
            "attn_decode_fp8: row at byte {bad} ends past the pool ({pool_bytes} bytes)"
        ));
    }
    Ok(batch)
}

/// A synthetic batch for tests and benchmarks: FP8 rows at odd byte offsets of one pool.
#[derive(Debug, Clone)]
pub struct Synthetic {
    pub shape: Fp8AttnShape,
    pub q: Vec<f32>,
    pub pool: Vec<u8>,
    pub offsets: Vec<i64>,
    pub starts: Vec<i64>,
    pub sinks: Vec<f32>,
    /// Per request, the largest |value| of its stored rows (the error bound's unit).
    pub amax: Vec<f32>,
}

/// `counts[b]` rows for request `b`, of random values whose magnitude varies with the dim (so
/// the blocks' scales differ), encoded as the engine stores them, each at its own odd offset;
/// with `empty_every > 0`, every such row from the fourth is an empty slot instead.
pub fn synthetic(
    rng: &mut engine::synth::Rng,
    shape: Fp8AttnShape,
    counts: &[usize],
    empty_every: usize,
) -> Synthetic {
    use engine::paged::{codec, layout::RowFormat};
    let (dim, row_bytes) = (shape.dim(), shape.row_bytes());
    let format = RowFormat::Fp8Kv {
        nope: shape.nope,
        rope: shape.rope,
    };
    let mut pool = vec![0xEEu8; 3];
    let (mut offsets, mut starts, mut amax) = (Vec::new(), vec![0i64], Vec::new());
    for &count in counts {
        let mut big = 0f32;
        for r in 0..count {
            if empty_every > 0 && r % empty_every == 3 {
                offsets.push(EMPTY_SLOT);
                continue;
            }
            let row: Vec<f32> = (0..dim)
                .map(|d| rng.normal() * (1.0 + (d % 64) as f32 / 16.0))
                .collect();
            let at = pool.len();
            pool.resize(at + row_bytes + (r % 3), 0xEE);
            codec::encode(format, &row, &mut pool[at..at + row_bytes]);
            let stored = codec::decode(format, &pool[at..at + row_bytes], dim);
            big = stored.iter().fold(big, |m, v| m.max(v.abs()));
            offsets.push(at as i64);
        }
        starts.push(offsets.len() as i64);
        amax.push(big);
    }
    let q = (0..counts.len() * shape.heads * dim)
        .map(|_| rng.normal())
        .collect();
    let sinks = (0..shape.heads).map(|_| rng.normal()).collect();
    Synthetic {
        shape,
        q,
        pool,
        offsets,
        starts,
        sinks,
        amax,
    }
}

impl Synthetic {
    /// The largest error of `got` against `want` (the reference's output) in units of the
    /// stated bound, `2^-8 · max |row value|` of the request plus 1e-6; NaN where exactly one
    /// of them is NaN.
    pub fn worst(&self, got: &[f32], want: &[f32]) -> f32 {
        let per_request = self.shape.heads * self.shape.dim();
        crate::compare::worst_ratio(got, want, |i| self.amax[i / per_request] / 256.0 + 1e-6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_covers_every_tile_once_within_its_capacity() {
        let mut rng = engine::synth::Rng::for_tensor(5, "attn-fp8-plan");
        for round in 0..300 {
            let batch = 1 + (rng.next_u64() % 40) as usize;
            let parts = 1 + (rng.next_u64() % 200) as usize;
            let mut starts = vec![0i64];
            for _ in 0..batch {
                let count = match rng.next_u64() % 4 {
                    0 => 0,
                    1 => (rng.next_u64() % 20) as i64,
                    _ => (rng.next_u64() % 3000) as i64,
                };
                starts.push(starts.last().unwrap() + count);
            }
            let (items, split_starts) = plan(&starts, parts);
            assert!(items.len() <= batch + parts, "round {round}");
            assert_eq!(split_starts.len(), batch + 1);
            for b in 0..batch {
                let mine = &items[split_starts[b]..split_starts[b + 1]];
                let tiles = ((starts[b + 1] - starts[b] + 15) / 16).max(1);
                let mut next = 0;
                for item in mine {
                    assert_eq!((item.request, item.lo), (b, next), "round {round}");
                    assert!(item.hi > item.lo);
                    next = item.hi;
                }
                assert_eq!(next, tiles, "round {round}: request {b}");
            }
        }
    }

    #[test]
    fn shapes_past_the_kernels_limits_are_refused() {
        let ok = Fp8AttnShape {
            heads: 64,
            nope: 448,
            rope: 64,
            scale: 0.04,
            parts: 132,
        };
        ok.check().unwrap();
        assert_eq!(ok.row_bytes(), 584);
        // 64 heads of 512: within the 99 KiB a block may have on sm_120.
        assert!(ok.smem_bytes() <= 101_376, "{}", ok.smem_bytes());
        for bad in [
            Fp8AttnShape { heads: 65, ..ok },
            Fp8AttnShape { heads: 0, ..ok },
            Fp8AttnShape { nope: 512, ..ok },
            Fp8AttnShape { parts: 0, ..ok },
            Fp8AttnShape {
                scale: f32::NAN,
                ..ok
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
        let shape = Fp8AttnShape {
            heads: 2,
            nope: 24,
            rope: 8,
            ..ok
        };
        let row = shape.row_bytes();
        assert_eq!(row, 24 + 16 + 8);
        let q = 2 * 2 * 32;
        assert_eq!(
            check_inputs(&shape, q, 10 * row, &[0, -1, -2], &[0, 1, 3], 2),
            Ok(2)
        );
        for (offsets, starts) in [
            (vec![9 * row as i64 + 1], vec![0, 1, 1]),
            (vec![0, 0], vec![0, 3, 2]),
            (vec![0, 0], vec![1, 1, 2]),
            (vec![0, 0], vec![0, 1, 1]),
            (vec![i64::MAX - 3], vec![0, 1, 1]),
        ] {
            assert!(
                check_inputs(&shape, q, 10 * row, &offsets, &starts, 2).is_err(),
                "{offsets:?} {starts:?}"
            );
        }
        assert!(check_inputs(&shape, q - 1, 10 * row, &[], &[0, 0, 0], 2).is_err());
    }
}
