//! The indexer's scores on tensor cores (`indexer.cu` `indexer_scores_mma`, the fast
//! attention's indexer): its launch geometry, its CPU reference and the bound it is held to.
//!
//! `score[t][s] = Σ_h relu(bf16(q_th) · bf16(key_s)) · scale · w_th` over a token's visible
//! keys (row `starts[t] + s` of `keys`), products exact, f32 sums: the exact kernel's scores
//! (`indexer_scores`, the engine's bits) with queries and keys rounded to bf16. The reference
//! sums in f64 over the same bf16 operands; the kernel is within
//! `(dim + heads + 16) · 2^-23 · Σ_h |w_th · scale| Σ_d |q16 · k16|` of it ([`bound`]).
//! NaN in, NaN out.

use engine::synth::Rng;

use crate::{dense_gemm::bf16, step::kernels::ScoreSpec};

/// Keys per MMA tile, tiles per block, threads per block.
pub const KEYS: usize = crate::cuda_constants::indexer::MMA_KEYS;
pub const TILES: usize = crate::cuda_constants::indexer::MMA_TILES;
pub const THREADS: usize = crate::cuda_constants::indexer::MMA_THREADS;
/// Dynamic shared memory a block may take without opting in to more.
pub const MAX_SHARED_BYTES: usize = 48 * 1024;

/// The operands of one launch: queries `[tokens, heads, dim]`, head weights `[tokens, heads]`,
/// f32 key rows of `dim`, each token's first row and visible count.
#[derive(Debug, Clone, Copy)]
pub struct ScoreInputs<'a> {
    pub q: &'a [f32],
    pub w: &'a [f32],
    pub keys: &'a [f32],
    pub starts: &'a [i64],
    pub visible: &'a [i32],
}

/// Random operands for the tests: normal queries and keys, weights of 0.3 sigma, each token's
/// key rows after a gap of three; with `poison` (and two tokens, the first with more than
/// five keys) key 5 of the first token and a query value of the second are NaN.
#[derive(Debug, Clone)]
pub struct SyntheticScores {
    pub q: Vec<f32>,
    pub w: Vec<f32>,
    pub keys: Vec<f32>,
    pub starts: Vec<i64>,
    pub visible: Vec<i32>,
    pub spec: ScoreSpec,
    pub poisoned: bool,
}

impl SyntheticScores {
    pub fn new(
        rng: &mut Rng,
        (heads, dim): (usize, usize),
        visible: &[usize],
        poison: bool,
    ) -> Self {
        let tokens = visible.len();
        let mut q: Vec<f32> = (0..tokens * heads * dim).map(|_| rng.normal()).collect();
        let w = (0..tokens * heads).map(|_| rng.normal() * 0.3).collect();
        let (mut starts, mut rows) = (Vec::new(), 0usize);
        for &v in visible {
            rows += 3;
            starts.push(rows as i64);
            rows += v;
        }
        let mut keys: Vec<f32> = (0..rows * dim).map(|_| rng.normal()).collect();
        let poisoned = poison && tokens > 1 && visible[0] > 5;
        if poisoned {
            keys[(starts[0] as usize + 5) * dim + dim / 2] = f32::NAN;
            q[heads * dim + 1] = f32::NAN;
        }
        let spec = ScoreSpec {
            tokens,
            heads,
            dim,
            scale: 1.0 / (dim as f32).sqrt(),
            max_keys: visible.iter().copied().max().unwrap_or(0).max(1),
            tensor_cores: true,
        };
        let visible = visible.iter().map(|&v| v as i32).collect();
        Self {
            q,
            w,
            keys,
            starts,
            visible,
            spec,
            poisoned,
        }
    }

    pub fn inputs(&self) -> ScoreInputs<'_> {
        ScoreInputs {
            q: &self.q,
            w: &self.w,
            keys: &self.keys,
            starts: &self.starts,
            visible: &self.visible,
        }
    }

    /// Where poisoned: whether `got` has the first token's key 5 NaN, its key 4 not, and
    /// every score of the second token NaN.
    pub fn poison_shows(&self, got: &[f32]) -> bool {
        let second = &got[self.spec.max_keys..self.spec.max_keys + self.visible[1] as usize];
        got[5].is_nan() && !got[4].is_nan() && second.iter().all(|v| v.is_nan())
    }
}

/// Heads and dims padded to whole MMA tiles.
pub fn padded(heads: usize, dim: usize) -> (usize, usize) {
    (heads.div_ceil(16) * 16, dim.div_ceil(16) * 16)
}

/// The kernel's dynamic shared memory: the padded queries and one tile of keys, in bf16 rows
/// of `dim_p + 8`.
pub fn shared_bytes(heads: usize, dim: usize) -> usize {
    let (heads_p, dim_p) = padded(heads, dim);
    (heads_p + KEYS) * (dim_p + 8) * 2
}

/// Whether the kernel takes `heads` x `dim` (its shared memory within a block's default).
pub fn check_shape(heads: usize, dim: usize) -> Result<(), String> {
    let bytes = shared_bytes(heads, dim);
    if heads == 0 || dim == 0 || bytes > MAX_SHARED_BYTES {
        return Err(format!(
            "tensor-core indexer scores: {heads} heads of {dim} need {bytes} bytes of shared \
             memory (at most {MAX_SHARED_BYTES})"
        ));
    }
    Ok(())
}

/// The grid: `(key groups of TILES tiles, tokens)`.
pub fn grid(spec: &ScoreSpec) -> (usize, usize) {
    (spec.max_keys.div_ceil(KEYS * TILES).max(1), spec.tokens)
}

/// Whether the operands hold what `spec` reads: every token's visible rows inside `keys`, at
/// most `max_keys` of them.
pub fn check(x: &ScoreInputs<'_>, spec: &ScoreSpec) -> Result<(), String> {
    let (n, heads, dim) = (spec.tokens, spec.heads, spec.dim);
    let rows = x.keys.len() / dim.max(1);
    let fits = x.q.len() >= n * heads * dim
        && x.w.len() >= n * heads
        && x.starts.len() >= n
        && x.visible.len() >= n
        && (0..n).all(|t| {
            let (start, seen) = (x.starts[t], x.visible[t]);
            start >= 0
                && seen >= 0
                && seen as usize <= spec.max_keys
                && start as usize + seen as usize <= rows
        });
    if fits {
        Ok(())
    } else {
        Err(format!(
            "indexer scores: {n} tokens x {heads} heads x {dim}, {rows} key rows"
        ))
    }
}

/// `(f64 score, its magnitude Σ_h |w · scale| Σ_d |q16 k16|)` of key `s` of token `t`.
fn score(x: &ScoreInputs<'_>, spec: &ScoreSpec, t: usize, s: usize) -> (f64, f64) {
    let (heads, dim) = (spec.heads, spec.dim);
    let row = x.starts[t] as usize + s;
    let key = &x.keys[row * dim..(row + 1) * dim];
    let (mut total, mut mag) = (0.0f64, 0.0f64);
    for h in 0..heads {
        let qh = &x.q[(t * heads + h) * dim..(t * heads + h + 1) * dim];
        let (dot, size) = qh.iter().zip(key).fold((0.0f64, 0.0f64), |(d, m), (a, b)| {
            let p = f64::from(bf16(*a)) * f64::from(bf16(*b));
            (d + p, m + p.abs())
        });
        let relu = if dot.is_nan() { dot } else { dot.max(0.0) };
        let weight = f64::from(spec.scale) * f64::from(x.w[t * heads + h]);
        total += relu * weight;
        mag += size * weight.abs();
    }
    (total, mag)
}

/// The reference scores `[tokens, max_keys]` (f64 sums rounded once; positions past a token's
/// visible keys are NaN: the kernel does not write them).
pub fn reference(x: &ScoreInputs<'_>, spec: &ScoreSpec) -> Result<Vec<f32>, String> {
    check(x, spec)?;
    let mut out = vec![f32::NAN; spec.tokens * spec.max_keys];
    for t in 0..spec.tokens {
        for s in 0..x.visible[t] as usize {
            out[t * spec.max_keys + s] = score(x, spec, t, s).0 as f32;
        }
    }
    Ok(out)
}

/// The bound of each visible score (0 past them).
pub fn bound(x: &ScoreInputs<'_>, spec: &ScoreSpec) -> Result<Vec<f64>, String> {
    check(x, spec)?;
    let per = (spec.dim + spec.heads + 16) as f64 * f64::from(f32::EPSILON);
    let mut out = vec![0.0; spec.tokens * spec.max_keys];
    for t in 0..spec.tokens {
        for s in 0..x.visible[t] as usize {
            let mag = score(x, spec, t, s).1;
            out[t * spec.max_keys + s] = per * mag + f64::from(f32::MIN_POSITIVE);
        }
    }
    Ok(out)
}

/// How many visible scores are outside their bound, or NaN where the reference is not (or the
/// reverse).
pub fn mismatches(
    got: &[f32],
    want: &[f32],
    bound: &[f64],
    visible: &[i32],
    spec: &ScoreSpec,
) -> usize {
    let mut bad = 0;
    for (t, &seen) in visible.iter().enumerate().take(spec.tokens) {
        for s in 0..seen.max(0) as usize {
            let at = t * spec.max_keys + s;
            let (g, w) = (got[at], want[at]);
            bad += usize::from(if g.is_nan() || w.is_nan() {
                g.is_nan() != w.is_nan()
            } else {
                f64::from((g - w).abs()) > bound[at]
            });
        }
    }
    bad
}
