//! The grouping of a chunk's (token, expert) pairs by expert that `moe_align.cu` computes on
//! the device for the grouped GEMM (`nvfp4_gemm.cu` `nvfp4_grouped_gemm_bf16`): what the
//! launch wrapper sizes and checks, and what the emulation runs.

/// Pairs per tile (the GEMM's 64 rows).
pub const TILE_ROWS: usize = crate::cuda_constants::moe_align::TILE_ROWS;
const _: () = assert!(
    TILE_ROWS == crate::cuda_constants::nvfp4_gemm::BM,
    "a tile of pairs is a GEMM tile"
);

/// The most tiles `pairs` pairs over `experts` experts can need: the grid and buffers are
/// sized by it, so a captured graph fits any routing.
pub fn max_tiles(pairs: usize, experts: usize) -> usize {
    pairs.div_ceil(TILE_ROWS) + experts
}

/// The device's grouping after `moe_align` and `moe_scatter`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grouping {
    /// First tile of each expert, `experts + 1` entries.
    pub tile_starts: Vec<usize>,
    /// The expert of each tile.
    pub tile_expert: Vec<usize>,
    /// `TILE_ROWS` slots per tile: a pair, or `None` (padding).
    pub sorted_pair: Vec<Option<usize>>,
}

/// `moe_count`, `moe_align` and `moe_scatter` with the atomics arriving in `arrival` order (a
/// permutation of the pairs): pairs whose expert is outside `0..experts` are left out.
pub fn group(pair_expert: &[i32], experts: usize, arrival: &[usize]) -> Grouping {
    let valid = |e: i32| usize::try_from(e).ok().filter(|&e| e < experts);
    let mut counts = vec![0usize; experts];
    for &e in pair_expert {
        if let Some(e) = valid(e) {
            counts[e] += 1;
        }
    }
    let mut tile_starts = Vec::with_capacity(experts + 1);
    let mut tile_expert = Vec::new();
    for (e, &count) in counts.iter().enumerate() {
        tile_starts.push(tile_expert.len());
        tile_expert.extend(std::iter::repeat_n(e, count.div_ceil(TILE_ROWS)));
    }
    tile_starts.push(tile_expert.len());
    let mut sorted_pair = vec![None; tile_expert.len() * TILE_ROWS];
    let mut cursor = vec![0usize; experts];
    for &p in arrival {
        if let Some(e) = valid(pair_expert[p]) {
            sorted_pair[tile_starts[e] * TILE_ROWS + cursor[e]] = Some(p);
            cursor[e] += 1;
        }
    }
    Grouping {
        tile_starts,
        tile_expert,
        sorted_pair,
    }
}

/// Checks a grouped GEMM's host inputs: every pair's token inside `tokens`, `k` a multiple of
/// the scale block (16 for NVFP4, whose `scale_2_len` is given; 32 for MXFP4, `None`), the
/// stacked experts' bytes and scales for `experts` experts of `[n, k]`. Expert indices are not
/// checked here: one outside the model gets a NaN row.
pub fn check(
    (tokens, pairs, experts): (usize, usize, usize),
    (n, k): (usize, usize),
    pair_token: &[i32],
    (a_len, packed_len, scales_len): (usize, usize, usize),
    scale_2_len: Option<usize>,
) -> Result<(), String> {
    let block = if scale_2_len.is_some() { 16 } else { 32 };
    if n == 0 || k == 0 || !k.is_multiple_of(block) || experts == 0 {
        return Err(format!(
            "grouped gemm: n {n}, k {k} (a multiple of {block}), experts {experts} must not be 0"
        ));
    }
    if pair_token.len() != pairs
        || a_len != tokens * k
        || packed_len != experts * n * k / 2
        || scales_len != experts * n * k / block
        || scale_2_len.is_some_and(|len| len != experts)
    {
        return Err(format!(
            "grouped gemm: buffers do not match {tokens} tokens, {pairs} pairs and {experts} \
             experts of {n}x{k}"
        ));
    }
    if pairs > i32::MAX as usize / 2 {
        return Err(format!("grouped gemm: {pairs} pairs"));
    }
    if let Some(bad) = pair_token
        .iter()
        .find(|&&t| usize::try_from(t).is_ok_and(|t| t >= tokens) || t < 0)
    {
        return Err(format!(
            "grouped gemm: pair token {bad} outside 0..{tokens}"
        ));
    }
    Ok(())
}

/// A synthetic prefill chunk for tests and benchmarks: tokens, routed pairs (some to an
/// expert outside the stack when `bad_every > 0`) and stacked NVFP4 experts.
#[derive(Debug, Clone)]
pub struct SyntheticMoe {
    pub tokens: usize,
    pub n: usize,
    pub k: usize,
    pub a: Vec<f32>,
    pub pair_token: Vec<i32>,
    pub pair_expert: Vec<i32>,
    pub packed: Vec<u8>,
    pub scales: Vec<u8>,
    /// NVFP4's global scale per expert; empty for MXFP4.
    pub scale_2: Vec<f32>,
    pub experts: usize,
    /// MXFP4 (ue8m0 scales per 32) rather than NVFP4.
    pub mx: bool,
    /// The experts dequantized, `[experts, n, k]` (for error bounds).
    pub dequant: Vec<f32>,
}

/// `tokens` tokens each routed to `top_k` distinct experts of `experts` (NVFP4), skewed so that
/// some experts get many pairs and some none; every `bad_every`-th pair to an expert outside
/// the stack. `k` must be a multiple of 16.
pub fn synthetic_moe(
    rng: &mut engine::synth::Rng,
    route: (usize, usize, usize),
    nk: (usize, usize),
    bad_every: usize,
) -> Result<SyntheticMoe, engine::quant::QuantError> {
    synthetic(rng, route, nk, bad_every, false)
}

/// The same chunk over MXFP4 experts (`k` a multiple of 32).
pub fn synthetic_mxfp4_moe(
    rng: &mut engine::synth::Rng,
    route: (usize, usize, usize),
    nk: (usize, usize),
    bad_every: usize,
) -> Result<SyntheticMoe, engine::quant::QuantError> {
    synthetic(rng, route, nk, bad_every, true)
}

fn synthetic(
    rng: &mut engine::synth::Rng,
    (tokens, top_k, experts): (usize, usize, usize),
    (n, k): (usize, usize),
    bad_every: usize,
    mx: bool,
) -> Result<SyntheticMoe, engine::quant::QuantError> {
    let a: Vec<f32> = (0..tokens * k).map(|_| rng.normal()).collect();
    let (mut pair_token, mut pair_expert) = (Vec::new(), Vec::new());
    for t in 0..tokens {
        let mut chosen: Vec<i32> = Vec::new();
        while chosen.len() < top_k.min(experts) {
            // Squaring a uniform draw favours the low experts.
            let u = rng.uniform();
            let e = ((u * u) * experts as f32) as i32 % experts as i32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        for e in chosen {
            pair_token.push(t as i32);
            let bad = bad_every > 0 && pair_expert.len() % bad_every == bad_every - 1;
            pair_expert.push(if bad { experts as i32 + 3 } else { e });
        }
    }
    let (mut packed, mut scales, mut scale_2, mut dequant) = (vec![], vec![], vec![], vec![]);
    for _ in 0..experts {
        let w: Vec<f32> = (0..n * k).map(|_| rng.normal()).collect();
        if mx {
            let (p, s) = engine::quant::quant_mxfp4(&w, n, k)?;
            dequant.extend(engine::quant::dequant_mxfp4(&p, &s, n, k)?);
            packed.extend(p);
            scales.extend(s);
        } else {
            let (p, s, s2) = engine::quant::quant_nvfp4(&w, n, k)?;
            dequant.extend(engine::quant::dequant_nvfp4(&p, &s, s2, n, k)?);
            packed.extend(p);
            scales.extend(s);
            scale_2.push(s2);
        }
    }
    Ok(SyntheticMoe {
        tokens,
        n,
        k,
        a,
        pair_token,
        pair_expert,
        packed,
        scales,
        scale_2,
        experts,
        mx,
        dequant,
    })
}

impl SyntheticMoe {
    /// Each pair's output by the reference of its format (`cpu::nvfp4_gemm` or
    /// `cpu::mxfp4_gemm`, bf16 activations, f64 sums): `[pairs, n]`, a NaN row for an expert
    /// outside the stack.
    pub fn reference(&self) -> Result<Vec<f32>, engine::quant::QuantError> {
        let (n, k) = (self.n, self.k);
        let block = if self.mx { 32 } else { 16 };
        let (code_bytes, scale_bytes) = (n * k / 2, n * k / block);
        let mut out = Vec::with_capacity(self.pair_token.len() * n);
        for (&t, &e) in self.pair_token.iter().zip(&self.pair_expert) {
            let Some(e) = usize::try_from(e).ok().filter(|&e| e < self.experts) else {
                out.extend(std::iter::repeat_n(f32::NAN, n));
                continue;
            };
            let x = &self.a[t as usize * k..(t as usize + 1) * k];
            let packed = &self.packed[e * code_bytes..(e + 1) * code_bytes];
            let scales = &self.scales[e * scale_bytes..(e + 1) * scale_bytes];
            out.extend(if self.mx {
                crate::cpu::mxfp4_gemm(x, packed, scales, (1, n, k))?
            } else {
                crate::cpu::nvfp4_gemm(x, packed, scales, self.scale_2[e], 1, n, k)?
            });
        }
        Ok(out)
    }

    /// The largest error of `got` against `want` in units of the bound, `1e-4 · Σ|a·w|` (bf16
    /// activations, exact weights: the products are exact, the f32 sums are not); NaN where
    /// exactly one of them is NaN.
    pub fn worst(&self, got: &[f32], want: &[f32]) -> f32 {
        let (n, k) = (self.n, self.k);
        let experts = self.experts;
        crate::compare::worst_ratio(got, want, |i| {
            let (p, j) = (i / n, i % n);
            let (t, e) = (
                self.pair_token[p] as usize,
                self.pair_expert[p] as usize % experts,
            );
            let row = &self.dequant[(e * n + j) * k..(e * n + j + 1) * k];
            let mag: f32 = self.a[t * k..(t + 1) * k]
                .iter()
                .zip(row)
                .map(|(x, y)| (x * y).abs())
                .sum();
            1e-4 * mag + 1e-30
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every valid pair lands in exactly one slot of its expert's tiles, whatever the arrival
    /// order; padding only at the end of an expert's last tile; within the tile bound.
    #[test]
    fn grouping_places_every_pair_once_within_the_bound() {
        let mut rng = engine::synth::Rng::for_tensor(3, "moe-group");
        for round in 0..200 {
            let experts = 1 + (rng.next_u64() % 300) as usize;
            let pairs = (rng.next_u64() % 2000) as usize;
            let pair_expert: Vec<i32> = (0..pairs)
                .map(|_| match rng.next_u64() % 50 {
                    0 => -1,
                    1 => experts as i32,
                    _ => (rng.next_u64() % experts as u64) as i32,
                })
                .collect();
            let mut arrival: Vec<usize> = (0..pairs).collect();
            for i in (1..pairs).rev() {
                arrival.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            let g = group(&pair_expert, experts, &arrival);
            assert!(
                g.tile_expert.len() <= max_tiles(pairs, experts),
                "round {round}"
            );
            let mut seen = vec![false; pairs];
            for (t, &e) in g.tile_expert.iter().enumerate() {
                let slots = &g.sorted_pair[t * TILE_ROWS..(t + 1) * TILE_ROWS];
                let last = t + 1 == g.tile_starts[e + 1];
                for (i, slot) in slots.iter().enumerate() {
                    match slot {
                        Some(p) => {
                            assert_eq!(pair_expert[*p], e as i32);
                            assert!(!seen[*p]);
                            seen[*p] = true;
                        }
                        None => assert!(last && slots[i..].iter().all(Option::is_none)),
                    }
                }
            }
            for (p, &e) in pair_expert.iter().enumerate() {
                assert_eq!(
                    seen[p],
                    (0..experts as i32).contains(&e),
                    "round {round} pair {p}"
                );
            }
        }
    }

    #[test]
    fn bad_grouped_inputs_are_refused() {
        let ok = |tokens, pair_token: &[i32], k| {
            check(
                (tokens, pair_token.len(), 2),
                (8, k),
                pair_token,
                (tokens * k, 2 * 8 * k / 2, 2 * 8 * k / 16),
                Some(2),
            )
        };
        assert_eq!(ok(3, &[0, 2, 1], 32), Ok(()));
        assert!(ok(3, &[0, 3], 32).is_err(), "token past the chunk");
        assert!(ok(3, &[-1], 32).is_err(), "negative token");
        assert!(ok(3, &[0], 24).is_err(), "k not whole blocks");
        assert!(check((1, 1, 2), (8, 32), &[0], (32, 1, 32), Some(2)).is_err());
        // MXFP4: a scale per 32, no global scale; k of whole 32-blocks.
        let mx = |k: usize| check((1, 1, 2), (8, k), &[0], (k, 8 * k, 2 * 8 * k / 32), None);
        assert_eq!(mx(64), Ok(()));
        assert!(mx(48).is_err(), "k not whole MXFP4 blocks");
    }
}
