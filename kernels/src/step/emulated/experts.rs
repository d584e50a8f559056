//! The routed experts' CPU references of [`super::EmulatedKernels`]: routing, and each pair's
//! expert times its token, exactly as the engine or as the fast grouped GEMV's reference.

use engine::{
    model::moe,
    tensor::{Weight, WeightForm},
};

use super::{err, index, part, store};
use crate::step::{ShapeError, kernels::RouteSpec};

/// (experts, rows, cols) of a stack of routed experts.
fn stack_shape(stack: &[Weight]) -> (usize, usize, usize) {
    stack
        .first()
        .map_or((0, 0, 0), |w| (stack.len(), w.rows, w.cols))
}

pub(super) fn moe_route(
    logits: &[f32],
    bias: Option<&Vec<f32>>,
    hash: Option<&Vec<u32>>,
    tokens: &[i32],
    sp: RouteSpec,
    (chosen, weights): (&mut [i32], &mut [f32]),
) -> Result<(), ShapeError> {
    let (e, k) = (sp.experts, sp.k);
    for t in 0..sp.tokens {
        let l = part(logits, t * e, e, "moe_route logits")?;
        let token = tokens[t];
        // As the kernel: a token outside the hash table, or an entry outside the experts,
        // routes nowhere (experts -1, weights NaN).
        let bad = hash.is_some_and(|table| {
            usize::try_from(token).map_or(true, |row| {
                row >= sp.table_rows
                    || table[row * k..(row + 1) * k]
                        .iter()
                        .any(|&x| x as usize >= e)
            })
        });
        let (c, w) = if bad {
            (vec![-1; k], vec![f32::NAN; k])
        } else {
            let (c, w) = moe::route_scores(
                &l,
                bias.map(Vec::as_slice),
                hash.map(Vec::as_slice),
                token as u32,
                (k, sp.scaling),
            );
            (c.iter().map(|&x| x as i32).collect(), w)
        };
        chosen[t * k..(t + 1) * k].copy_from_slice(&c);
        weights[t * k..(t + 1) * k].copy_from_slice(&w);
    }
    Ok(())
}

pub(super) fn exact_pairs(
    stack: &[Weight],
    pairs_of: (&[i32], &[i32]),
    x: &[f32],
    pairs: usize,
    y: &mut [f32],
) -> Result<(), ShapeError> {
    each_pair(stack, pairs_of, (x, pairs, y), |w, xt| Ok(w.apply(xt)))
}

pub(super) fn fast_pairs(
    stack: &[Weight],
    pairs_of: (&[i32], &[i32]),
    x: &[f32],
    pairs: usize,
    y: &mut [f32],
) -> Result<(), ShapeError> {
    let (_, rows, cols) = stack_shape(stack);
    each_pair(stack, pairs_of, (x, pairs, y), |w, xt| {
        let fast = |e: engine::quant::QuantError| ShapeError(e.to_string());
        match w.form() {
            WeightForm::Nvfp4 {
                packed,
                scales,
                scale_2,
            } => crate::cpu::nvfp4_gemv(
                packed.as_slice(),
                scales.as_slice(),
                *scale_2,
                xt,
                rows,
                cols,
            )
            .map_err(fast),
            WeightForm::Mxfp4 { packed, scales } => {
                crate::cpu::mxfp4_gemv(packed.as_slice(), scales.as_slice(), xt, rows, cols)
                    .map_err(fast)
            }
            _ => Err(err("fast pairs: experts that are not FP4")),
        }
    })
}

/// The grouped GEMM's reference: each pair's `W · bf16(x)` in f64 (`cpu::nvfp4_gemm`,
/// `cpu::mxfp4_gemm` of one row); an expert outside the stack gives a NaN row, as the GEMM
/// (its output filled with NaN first, such a pair left out of every tile) does.
pub(super) fn gemm_pairs(
    stack: &[Weight],
    pairs_of: (&[i32], &[i32]),
    x: &[f32],
    pairs: usize,
    y: &mut [f32],
) -> Result<(), ShapeError> {
    each_pair(stack, pairs_of, (x, pairs, y), |w, xt| {
        crate::prefill_gemm::fp4_pair(w, xt).map_err(|e| ShapeError(e.to_string()))
    })
}

/// Pair p's expert `experts[p]` applied (`apply`) to row `tokens[p]` of `x`, into row p of
/// `y`; an expert outside the stack gives a NaN row, as the kernels do.
fn each_pair(
    stack: &[Weight],
    (tokens, experts): (&[i32], &[i32]),
    (x, pairs, y): (&[f32], usize, &mut [f32]),
    apply: impl Fn(&Weight, &[f32]) -> Result<Vec<f32>, ShapeError>,
) -> Result<(), ShapeError> {
    let (_, rows, cols) = stack_shape(stack);
    for p in 0..pairs {
        let out = match usize::try_from(experts[p]).ok().and_then(|e| stack.get(e)) {
            Some(w) => {
                let t = index(i64::from(tokens[p]), "pair token")?;
                apply(w, &part(x, t * cols, cols, "pairs input")?)?
            }
            None => vec![f32::NAN; rows],
        };
        store(y, p * rows, &out)?;
    }
    Ok(())
}
