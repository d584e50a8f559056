//! Dot products, one at a time or as a block of (weight rows × vectors).
//!
//! Every output has one fixed definition, whatever computes it: eight lanes, lane `k`
//! accumulating `a[8i+k]·b[8i+k]` with a fused multiply-add over the full chunks of eight, the
//! leftover elements accumulated into a separate scalar with fused multiply-adds, then the lanes
//! halved pairwise (4, 2, 1) and the scalar added last. The blocked kernel keeps one 8-lane
//! accumulator per output, so a block of 4 rows × 3 vectors has twelve independent chains (enough
//! to hide the FMA latency) and reads each loaded weight chunk for three vectors and each vector
//! chunk for four rows. Because outputs never share an accumulator, an output's bits do not
//! depend on the block it was computed in, on the other rows or vectors, or on the thread that ran
//! it: batch invariance and chunk invariance follow.
//!
//! On x86-64 with AVX2 and FMA the kernel uses 256-bit registers; elsewhere a portable version
//! with the same per-lane `mul_add` gives the same bits (tests compare the two).

#![allow(
    clippy::inline_always,
    reason = "the finish must inline into the AVX2 kernel to be compiled with its features"
)]

use super::rows::{F32Rows, LANES, RowSource};

#[cfg(target_arch = "x86_64")]
mod wide;

/// Weight rows per block.
const BLOCK_ROWS: usize = 4;
/// Vectors per block.
const BLOCK_VECTORS: usize = 3;
/// Vectors from which the AVX-512 kernel (`wide.rs`) takes a product, where the CPU has it.
const WIDE_MIN_VECTORS: usize = 4;

/// (rows, vectors) of one parallel task of a large product: the AVX-512 kernel decodes a
/// task's rows once for all its vectors, so it takes many vectors per task.
pub(super) fn task_shape() -> (usize, usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if wide::available() {
            return (64, 256);
        }
    }
    (256, 48)
}

/// `a · b` with the definition above (`a` and `b` have the same length).
pub fn dot<'a>(a: &'a [f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot of different lengths");
    // The 1x1 block of the kernel `dots` would reach, without its dispatch: norms take a dot per
    // token and head.
    let ws: [&'a [f32]; BLOCK_ROWS] = [a; BLOCK_ROWS];
    let vs: [&[f32]; BLOCK_VECTORS] = [b, &[], &[]];
    block::<F32Rows<fn(usize) -> &'a [f32]>, 1, 1>(has_avx2_fma(), &ws, &vs, a.len())[0][0]
}

/// `out[v * rows + r] = dot(row(r), xs[v])` for every row `r < rows` and vector `v`; every row
/// and vector has the same length. The result is vector-major so each vector's outputs are
/// contiguous.
pub fn dots<'a>(
    row: impl Fn(usize) -> &'a [f32] + Sync,
    rows: usize,
    xs: &[&[f32]],
    out: &mut [f32],
) {
    let cols = xs.first().map_or(0, |x| x.len());
    dots_source(&F32Rows { rows: row, cols }, 0, rows, xs, out);
}

/// Rows `r0..r0 + rows` of `src` times every vector, vector-major like [`dots`]. Each output
/// is the same [`dot`] of the decoded row whatever the source's format: stored weights give
/// bit for bit what their f32 expansion gives.
pub fn dots_source<S: RowSource>(src: &S, r0: usize, rows: usize, xs: &[&[f32]], out: &mut [f32]) {
    assert_eq!(out.len(), rows * xs.len(), "output size");
    if xs.is_empty() {
        return;
    }
    let n = src.cols();
    for (v, x) in xs.iter().enumerate() {
        assert_eq!(x.len(), n, "vector {v} length");
    }
    #[cfg(target_arch = "x86_64")]
    {
        if xs.len() >= WIDE_MIN_VECTORS && wide::available() {
            // SAFETY: the CPU has the kernel's features (just checked); every vector has n
            // elements and `out` has rows * xs.len() (both checked above).
            unsafe { wide::dots(src, r0, rows, xs, out) };
            return;
        }
    }
    let fast = has_avx2_fma();
    // Decoding a stored row costs about as much as three multiply-adds per element, so against
    // many vectors a block's rows are decoded once into f32 and read from cache.
    let mut scratch = if S::DECODES && xs.len() > BLOCK_VECTORS {
        vec![0.0f32; BLOCK_ROWS * n]
    } else {
        Vec::new()
    };
    // A block's rows are a quarter of the rows apart, so each of its rows is one forward stream
    // through memory. (Four neighbouring rows read side by side share a 4 KiB page, which the
    // hardware stream prefetcher does not follow: that halves the speed of a large matrix times
    // one vector.)
    let stride = rows.div_ceil(BLOCK_ROWS);
    for base in 0..stride {
        let mut at = [0usize; BLOCK_ROWS];
        let mut nr = 0;
        for r in (base..rows).step_by(stride).take(BLOCK_ROWS) {
            at[nr] = r;
            nr += 1;
        }
        let mut store = |block: &Block, v0: usize, nv: usize| {
            for (i, block_row) in block.iter().take(nr).enumerate() {
                for (j, value) in block_row.iter().take(nv).enumerate() {
                    out[(v0 + j) * rows + at[i]] = *value;
                }
            }
        };
        if scratch.is_empty() {
            let rows_at = at.map(|r| r0 + r);
            row_block(src, &rows_at, nr, fast, xs, n, &mut store);
        } else {
            for (i, &r) in at.iter().take(nr).enumerate() {
                decode_row(fast, src, r0 + r, &mut scratch[i * n..(i + 1) * n]);
            }
            let decoded = F32Rows {
                rows: |i: usize| &scratch[i * n..(i + 1) * n],
                cols: n,
            };
            row_block(&decoded, &[0, 1, 2, 3], nr, fast, xs, n, &mut store);
        }
    }
}

/// Row `r` of `src` decoded into `out` (`cols` values), eight at a time in registers when the
/// CPU has the features.
fn decode_row<S: RowSource>(fast: bool, src: &S, r: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if fast {
            // SAFETY: the CPU supports AVX2, FMA and F16C (`has_avx2_fma`).
            unsafe { decode_row_avx2(src, r, out) };
            return;
        }
    }
    let _ = fast;
    src.decode_row(r, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn decode_row_avx2<S: RowSource>(src: &S, r: usize, out: &mut [f32]) {
    let n = src.cols();
    assert_eq!(out.len(), n, "decoded row length");
    let row = src.row(r);
    let chunks = n / LANES;
    for i in 0..chunks {
        // SAFETY: (i + 1) * 8 <= n, the row's and `out`'s length; this function has the
        // features; unaligned store.
        unsafe {
            let v = S::chunk_avx2(row, i * LANES);
            std::arch::x86_64::_mm256_storeu_ps(out.as_mut_ptr().add(i * LANES), v);
        }
    }
    for (c, v) in out.iter_mut().enumerate().skip(chunks * LANES) {
        *v = S::get(row, c);
    }
}

/// Rows `rows[..nr]` of `src` against every vector, a block of up to three vectors at a time;
/// `store(block, v0, nv)` takes each block's results.
fn row_block<S: RowSource>(
    src: &S,
    rows: &[usize; BLOCK_ROWS],
    nr: usize,
    fast: bool,
    xs: &[&[f32]],
    n: usize,
    store: &mut impl FnMut(&Block, usize, usize),
) {
    let ws: [S::Row<'_>; BLOCK_ROWS] = std::array::from_fn(|i| src.row(rows[i.min(nr - 1)]));
    for_vector_blocks(xs, |v0, vs, nv| {
        store(&block_any::<S>(fast, nr, nv, &ws, vs, n), v0, nv);
    });
}

/// Calls `each(v0, vectors, count)` for consecutive groups of up to three vectors.
fn for_vector_blocks<'x>(
    xs: &[&'x [f32]],
    mut each: impl FnMut(usize, &[&'x [f32]; BLOCK_VECTORS], usize),
) {
    let mut v0 = 0;
    while v0 < xs.len() {
        let nv = BLOCK_VECTORS.min(xs.len() - v0);
        let mut vs: [&[f32]; BLOCK_VECTORS] = [&[]; BLOCK_VECTORS];
        vs[..nv].copy_from_slice(&xs[v0..v0 + nv]);
        each(v0, &vs, nv);
        v0 += nv;
    }
}

/// Whether the vector kernel can run (checked once per call; the check itself is cached).
fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

type Block = [[f32; BLOCK_VECTORS]; BLOCK_ROWS];

/// One block of `nr` rows × `nv` vectors, dispatched to a kernel specialised for that shape
/// (the accumulators must be compile-time arrays to live in registers).
fn block_any<S: RowSource>(
    fast: bool,
    nr: usize,
    nv: usize,
    ws: &[S::Row<'_>; BLOCK_ROWS],
    vs: &[&[f32]; BLOCK_VECTORS],
    n: usize,
) -> Block {
    macro_rules! shapes {
        ($(($r:literal, $v:literal)),*) => {
            match (nr, nv) {
                $(($r, $v) => block::<S, $r, $v>(fast, ws, vs, n),)*
                _ => unreachable!("block shape {nr}x{nv}"),
            }
        };
    }
    shapes!(
        (1, 1),
        (1, 2),
        (1, 3),
        (2, 1),
        (2, 2),
        (2, 3),
        (3, 1),
        (3, 2),
        (3, 3),
        (4, 1),
        (4, 2),
        (4, 3)
    )
}

fn block<S: RowSource, const R: usize, const V: usize>(
    fast: bool,
    ws: &[S::Row<'_>; BLOCK_ROWS],
    vs: &[&[f32]; BLOCK_VECTORS],
    n: usize,
) -> Block {
    #[cfg(target_arch = "x86_64")]
    {
        if fast {
            // SAFETY: the CPU supports AVX2, FMA and F16C (`has_avx2_fma`); every row holds n
            // elements (`RowSource::row`) and every vector in the first V entries has length
            // n (checked by `dots_source`).
            return unsafe { block_avx2::<S, R, V>(ws, vs, n) };
        }
    }
    let _ = fast;
    block_portable::<S, R, V>(ws, vs, n)
}

/// The per-output finish shared by both kernels: the leftover elements into a scalar, the
/// lanes halved pairwise, the scalar added last.
#[inline(always)]
fn finish<S: RowSource>(mut lanes: [f32; LANES], a: S::Row<'_>, b: &[f32], from: usize) -> f32 {
    let mut tail = 0.0f32;
    for (i, bi) in b.iter().enumerate().skip(from) {
        tail = S::get(a, i).mul_add(*bi, tail);
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for k in 0..width {
            lanes[k] += lanes[k + width];
        }
    }
    lanes[0] + tail
}

fn block_portable<S: RowSource, const R: usize, const V: usize>(
    ws: &[S::Row<'_>; BLOCK_ROWS],
    vs: &[&[f32]; BLOCK_VECTORS],
    n: usize,
) -> Block {
    let chunks = n / LANES;
    let mut out = [[0.0f32; BLOCK_VECTORS]; BLOCK_ROWS];
    for r in 0..R {
        for v in 0..V {
            let (a, b) = (ws[r], vs[v]);
            let mut lanes = [0.0f32; LANES];
            for i in 0..chunks {
                let w = S::chunk(a, i * LANES);
                for (k, lane) in lanes.iter_mut().enumerate() {
                    *lane = w[k].mul_add(b[i * LANES + k], *lane);
                }
            }
            out[r][v] = finish::<S>(lanes, a, b, chunks * LANES);
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn block_avx2<S: RowSource, const R: usize, const V: usize>(
    ws: &[S::Row<'_>; BLOCK_ROWS],
    vs: &[&[f32]; BLOCK_VECTORS],
    n: usize,
) -> Block {
    use std::arch::x86_64::{__m256, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps};
    let chunks = n / LANES;
    let mut acc: [[__m256; V]; R] = [[_mm256_setzero_ps(); V]; R];
    let mut x: [__m256; V] = [_mm256_setzero_ps(); V];
    for i in 0..chunks {
        let at = i * LANES;
        for v in 0..V {
            // SAFETY: at + 8 <= chunks * 8 <= n = vs[v].len(); unaligned load.
            x[v] = unsafe { _mm256_loadu_ps(vs[v].as_ptr().add(at)) };
        }
        for r in 0..R {
            // SAFETY: at + 8 <= n = the row's length; this function has the features.
            let w = unsafe { S::chunk_avx2(ws[r], at) };
            for v in 0..V {
                acc[r][v] = _mm256_fmadd_ps(w, x[v], acc[r][v]);
            }
        }
    }
    let mut out = [[0.0f32; BLOCK_VECTORS]; BLOCK_ROWS];
    for r in 0..R {
        for v in 0..V {
            out[r][v] = finish_avx2::<S>(acc[r][v], ws[r], vs[v], chunks * LANES);
        }
    }
    out
}

/// [`finish`] in registers: the same additions in the same order (lanes `k` and `k + 4`, then
/// `k` and `k + 2`, then 0 and 1, the scalar tail last), so the same bits, without a trip of
/// the lanes through memory.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn finish_avx2<S: RowSource>(
    acc: std::arch::x86_64::__m256,
    a: S::Row<'_>,
    b: &[f32],
    from: usize,
) -> f32 {
    use std::arch::x86_64::{
        _mm_add_ps, _mm_add_ss, _mm_cvtss_f32, _mm_movehdup_ps, _mm_movehl_ps,
        _mm256_castps256_ps128, _mm256_extractf128_ps,
    };
    let mut tail = 0.0f32;
    for (i, bi) in b.iter().enumerate().skip(from) {
        tail = S::get(a, i).mul_add(*bi, tail);
    }
    let quad = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    let one = _mm_add_ss(pair, _mm_movehdup_ps(pair));
    _mm_cvtss_f32(one) + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vector(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 + seed) * 1.37).sin() * (1.0 + seed))
            .collect()
    }

    /// Row 0 of `src` times `x` on the portable kernel alone.
    fn single_portable<S: RowSource>(src: &S, x: &[f32]) -> f32 {
        let ws: [S::Row<'_>; BLOCK_ROWS] = std::array::from_fn(|_| src.row(0));
        let vs: [&[f32]; BLOCK_VECTORS] = [x, &[], &[]];
        block_portable::<S, 1, 1>(&ws, &vs, x.len())[0][0]
    }

    #[test]
    fn dot_matches_naive_at_awkward_lengths() {
        for n in [0usize, 1, 7, 8, 9, 31, 100, 1000] {
            let (a, b) = (vector(n, 0.5), vector(n, 2.0));
            let naive: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| f64::from(*x) * f64::from(*y))
                .sum();
            let scale: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (f64::from(*x) * f64::from(*y)).abs())
                .sum();
            assert!(
                (f64::from(dot(&a, &b)) - naive).abs() <= 1e-6 * scale.max(1.0),
                "{n}"
            );
        }
    }

    /// Every output of every block shape, on both kernels, equals the single-output portable
    /// definition bit for bit.
    #[test]
    fn blocks_and_kernels_agree_bit_for_bit() {
        for n in [0usize, 1, 5, 8, 13, 64, 67, 300] {
            let rows: Vec<Vec<f32>> = (0..7).map(|r| vector(n, r as f32 * 0.3)).collect();
            let xs: Vec<Vec<f32>> = (0..7).map(|v| vector(n, 10.0 + v as f32)).collect();
            let reference = |r: usize, v: usize| {
                let one = F32Rows {
                    rows: |_| rows[r].as_slice(),
                    cols: n,
                };
                single_portable(&one, &xs[v])
            };
            for nr in 0..=rows.len() {
                for nv in 0..=xs.len() {
                    let refs: Vec<&[f32]> = xs[..nv].iter().map(Vec::as_slice).collect();
                    let mut out = vec![f32::NAN; nr * nv];
                    dots(|r| &rows[r], nr, &refs, &mut out);
                    for v in 0..nv {
                        for r in 0..nr {
                            assert_eq!(
                                out[v * nr + r].to_bits(),
                                reference(r, v).to_bits(),
                                "n {n} rows {nr} vectors {nv} at ({r}, {v})"
                            );
                        }
                    }
                }
            }
            for (r, w) in rows.iter().enumerate() {
                for (v, x) in xs.iter().enumerate() {
                    assert_eq!(dot(w, x).to_bits(), reference(r, v).to_bits());
                }
            }
        }
    }

    /// Products with enough vectors for the AVX-512 kernel (where the CPU has it): several
    /// blocks of rows, partial blocks of rows and vectors, leftover elements; every output
    /// equals the portable single-output definition bit for bit, and NaN in gives NaN out.
    #[test]
    fn wide_products_agree_bit_for_bit() {
        for n in [1usize, 8, 13, 67, 256] {
            let rows: Vec<Vec<f32>> = (0..19).map(|r| vector(n, r as f32 * 0.7)).collect();
            let xs: Vec<Vec<f32>> = (0..11).map(|v| vector(n, 5.0 + v as f32)).collect();
            for (nr, nv) in [(19, 11), (8, 4), (9, 5), (1, 4), (17, 7), (16, 8), (3, 10)] {
                let refs: Vec<&[f32]> = xs[..nv].iter().map(Vec::as_slice).collect();
                let mut out = vec![f32::NAN; nr * nv];
                dots(|r| &rows[r], nr, &refs, &mut out);
                for v in 0..nv {
                    for r in 0..nr {
                        let one = F32Rows {
                            rows: |_| rows[r].as_slice(),
                            cols: n,
                        };
                        assert_eq!(
                            out[v * nr + r].to_bits(),
                            single_portable(&one, &xs[v]).to_bits(),
                            "n {n} rows {nr} vectors {nv} at ({r}, {v})"
                        );
                    }
                }
            }
            let mut poisoned = xs.clone();
            poisoned[2][n - 1] = f32::NAN;
            let refs: Vec<&[f32]> = poisoned.iter().map(Vec::as_slice).collect();
            let mut out = vec![0.0f32; 19 * refs.len()];
            dots(|r| &rows[r], 19, &refs, &mut out);
            for (i, value) in out.iter().enumerate() {
                assert_eq!(value.is_nan(), i / 19 == 2, "n {n} output {i}");
            }
        }
    }

    #[test]
    fn empty_inputs() {
        let mut out: Vec<f32> = Vec::new();
        dots(|_| &[], 0, &[], &mut out);
        dots(|_| &[], 3, &[], &mut out);
        let mut out = vec![1.0f32; 2];
        dots(|_| &[], 2, &[&[]], &mut out);
        assert_eq!(out, vec![0.0, 0.0]);
    }
}
