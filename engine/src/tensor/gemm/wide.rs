//! The dot-product kernel on AVX-512, for a block of rows against many vectors: the same
//! outputs, bit for bit, as the 256-bit and portable kernels of `gemm.rs`.
//!
//! A 512-bit register holds the eight lanes of two outputs: two weight rows side by side,
//! multiplied by one vector's chunk broadcast to both halves. A block's rows are first decoded
//! into a scratch where the chunks of each pair of rows interleave, so one load gives both rows'
//! chunk. Each output's lanes see the fused multiply-adds of the 256-bit kernel in the same
//! order; the lane halving at the end (lanes `k` and `k + 4`, then `k` and `k + 2`, then 0 and 1,
//! then the scalar tail) runs for sixteen outputs at once with the same additions, low lane
//! first. With eight rows × six vectors per block (24 accumulators of the 32 registers), a chunk
//! costs ten loads for twenty-four 512-bit multiply-adds (the 256-bit kernel needs seven loads
//! for twelve 256-bit ones), and the halving costs a fraction of the per-output shuffles it
//! replaces.

#![allow(
    clippy::needless_range_loop,
    reason = "register blocks indexed by compile-time bounds, as in gemm.rs"
)]

use std::arch::x86_64::{
    __m512, _mm256_loadu_ps, _mm256_setzero_ps, _mm256_storeu_ps, _mm512_add_ps,
    _mm512_broadcast_f32x8, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_permutex2var_ps,
    _mm512_setr_epi32, _mm512_setzero_ps, _mm512_shuffle_f32x4, _mm512_storeu_ps,
};

use super::super::rows::{LANES, RowSource};

/// Row pairs per block.
const PAIRS: usize = 4;
/// Rows per block.
const ROWS: usize = 2 * PAIRS;
/// Vectors per block.
const VECTORS: usize = 6;
/// Outputs of a full block.
const OUTPUTS: usize = ROWS * VECTORS;

/// Whether the CPU runs this kernel (checked once per call; the check itself is cached).
pub(super) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// Rows `r0..r0 + rows` of `src` times every vector, vector-major (`out[v * rows + r]`), as
/// `gemm::dots_source` defines each output.
///
/// # Safety
/// [`available`] returned true; every vector has `src.cols()` elements and `out` has
/// `rows * xs.len()`.
#[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn dots<S: RowSource>(
    src: &S,
    r0: usize,
    rows: usize,
    xs: &[&[f32]],
    out: &mut [f32],
) {
    let n = src.cols();
    let chunks = n / LANES;
    // Pair p's chunk i is at (p * chunks + i) * 16: the first row's eight values, then the
    // second's.
    let mut scratch = vec![0.0f32; PAIRS * chunks * 2 * LANES];
    let mut base = 0;
    while base < rows {
        let nr = ROWS.min(rows - base);
        let row_of = |i: usize| src.row(r0 + base + i.min(nr - 1));
        for i in 0..nr.next_multiple_of(2) {
            let (p, half) = (i / 2, i % 2);
            let slot = |c: usize| (p * chunks + c) * 2 * LANES + half * LANES;
            if i < nr {
                let row = row_of(i);
                for c in 0..chunks {
                    // SAFETY: c * 8 + 8 <= n; the slot is inside the scratch (p < PAIRS);
                    // the features are enabled on this function.
                    unsafe {
                        let value = S::chunk_avx2(row, c * LANES);
                        _mm256_storeu_ps(scratch.as_mut_ptr().add(slot(c)), value);
                    }
                }
            } else {
                for c in 0..chunks {
                    // SAFETY: as above.
                    unsafe {
                        _mm256_storeu_ps(scratch.as_mut_ptr().add(slot(c)), _mm256_setzero_ps());
                    };
                }
            }
        }
        let mut v0 = 0;
        while v0 < xs.len() {
            let nv = VECTORS.min(xs.len() - v0);
            let vs: [&[f32]; VECTORS] = std::array::from_fn(|v| xs[v0 + v.min(nv - 1)]);
            // SAFETY: the scratch holds nr.div_ceil(2) pairs of `chunks` chunks; every vector
            // has n >= chunks * 8 elements; the features are enabled on this function.
            let sums = unsafe { block_any(&scratch, chunks, nr.div_ceil(2), nv, &vs) };
            // Output 2 * (v * PAIRS + p) + half = 8v + i is row i = 2p + half times vector v:
            // a vector's outputs for the block's rows are consecutive, as in `out`.
            for v in 0..nv {
                let dst = &mut out[(v0 + v) * rows + base..][..nr];
                let block = &sums[ROWS * v..][..nr];
                if chunks * LANES == n {
                    // The empty tail is still added, as `finish` adds it: -0 becomes +0.
                    for (o, sum) in dst.iter_mut().zip(block) {
                        *o = sum + 0.0;
                    }
                } else {
                    for (i, (o, sum)) in dst.iter_mut().zip(block).enumerate() {
                        let mut tail = 0.0f32;
                        for (c, x) in vs[v].iter().enumerate().skip(chunks * LANES) {
                            tail = S::get(row_of(i), c).mul_add(*x, tail);
                        }
                        *o = sum + tail;
                    }
                }
            }
            v0 += nv;
        }
        base += nr;
    }
}

/// Every output of a block of `np` pairs × `nv` vectors (the rest zero), halved to one value
/// each, before the tail.
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn block_any(
    scratch: &[f32],
    chunks: usize,
    np: usize,
    nv: usize,
    vs: &[&[f32]; VECTORS],
) -> [f32; OUTPUTS] {
    macro_rules! shapes {
        ($(($p:literal, $v:literal)),*) => {
            match (np, nv) {
                // SAFETY: forwarded from this function's contract.
                $(($p, $v) => unsafe { block::<$p, $v>(scratch, chunks, vs) },)*
                _ => unreachable!("block shape {np}x{nv}"),
            }
        };
    }
    let acc = shapes!(
        (1, 1),
        (1, 2),
        (1, 3),
        (1, 4),
        (1, 5),
        (1, 6),
        (2, 1),
        (2, 2),
        (2, 3),
        (2, 4),
        (2, 5),
        (2, 6),
        (3, 1),
        (3, 2),
        (3, 3),
        (3, 4),
        (3, 5),
        (3, 6),
        (4, 1),
        (4, 2),
        (4, 3),
        (4, 4),
        (4, 5),
        (4, 6)
    );
    let mut sums = [0.0f32; OUTPUTS];
    for (half, regs) in acc.chunks_exact(8).enumerate() {
        let regs: &[__m512; 8] = regs.try_into().unwrap_or_else(|_| unreachable!());
        // SAFETY: 16 floats from half * 16 are inside `sums`; AVX-512F is enabled here.
        unsafe { _mm512_storeu_ps(sums.as_mut_ptr().add(half * 16), halve16(regs)) };
    }
    sums
}

/// The accumulators of `P` pairs × `V` vectors, at `v * PAIRS + p` (the others zero).
///
/// # Safety
/// The scratch holds `P` pairs of `chunks` interleaved chunks; the first `V` vectors have at
/// least `chunks * 8` elements; the CPU has AVX-512F and DQ.
#[target_feature(enable = "avx512f,avx512dq")]
#[inline]
unsafe fn block<const P: usize, const V: usize>(
    scratch: &[f32],
    chunks: usize,
    vs: &[&[f32]; VECTORS],
) -> [__m512; PAIRS * VECTORS] {
    debug_assert!(scratch.len() >= P * chunks * 2 * LANES);
    let mut acc = [[_mm512_setzero_ps(); P]; V];
    let w = scratch.as_ptr();
    for i in 0..chunks {
        let mut x = [_mm512_setzero_ps(); V];
        for v in 0..V {
            debug_assert!(vs[v].len() >= (i + 1) * LANES);
            // SAFETY: (i + 1) * 8 <= the vector's length (caller); unaligned load.
            x[v] =
                _mm512_broadcast_f32x8(unsafe { _mm256_loadu_ps(vs[v].as_ptr().add(i * LANES)) });
        }
        for p in 0..P {
            // SAFETY: pair p's chunk i is inside the scratch (caller); unaligned load.
            let wp = unsafe { _mm512_loadu_ps(w.add((p * chunks + i) * 2 * LANES)) };
            for v in 0..V {
                acc[v][p] = _mm512_fmadd_ps(wp, x[v], acc[v][p]);
            }
        }
    }
    let mut out = [_mm512_setzero_ps(); PAIRS * VECTORS];
    for v in 0..V {
        for p in 0..P {
            out[v * PAIRS + p] = acc[v][p];
        }
    }
    out
}

/// Sixteen outputs (two per register, low half first) halved as `finish` halves one: lanes
/// `k + 4` onto `k`, `k + 2` onto `k`, then 1 onto 0, each addition with the low lane first.
#[target_feature(enable = "avx512f")]
#[inline]
fn halve16(z: &[__m512; 8]) -> __m512 {
    // Four outputs × lanes 0..4 plus four outputs × lanes 4..8: 128-bit blocks 0 and 2 of each
    // register are its outputs' low lanes, blocks 1 and 3 their high lanes.
    let quads: [__m512; 4] = std::array::from_fn(|k| {
        let (a, b) = (z[2 * k], z[2 * k + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        )
    });
    let low2 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    let high2 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    let pairs: [__m512; 2] = std::array::from_fn(|k| {
        let (a, b) = (quads[2 * k], quads[2 * k + 1]);
        _mm512_add_ps(
            _mm512_permutex2var_ps(a, low2, b),
            _mm512_permutex2var_ps(a, high2, b),
        )
    });
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    _mm512_add_ps(
        _mm512_permutex2var_ps(pairs[0], even, pairs[1]),
        _mm512_permutex2var_ps(pairs[0], odd, pairs[1]),
    )
}
