use engine::synth::Rng;

use super::*;
use crate::{
    attn_fp8::{EMPTY_SLOT, Synthetic as Case, synthetic},
    cpu,
};

fn case(rng: &mut Rng, dims: (usize, usize, usize), counts: &[usize], parts: usize) -> Case {
    let (heads, nope, rope) = dims;
    let shape = Fp8AttnShape {
        heads,
        nope,
        rope,
        scale: 1.0 / ((nope + rope) as f32).sqrt(),
        parts,
    };
    synthetic(rng, shape, counts, 7)
}

/// The largest error against the reference in units of its bound.
fn worst(c: &Case, got: &[f32]) -> f32 {
    let want = cpu::attn_decode_fp8(&c.q, &c.pool, &c.offsets, &c.starts, &c.sinks, &c.shape);
    c.worst(got, &want)
}

fn run(c: &Case) -> Vec<f32> {
    attn_decode_fp8(&c.q, &c.pool, &c.offsets, &c.starts, &c.sinks, &c.shape)
}

/// A planted error: its name, a register hook and a change to the math.
type Planted<'a> = (&'a str, Tamper<'a>, Plant);

/// (heads, nope, rope), rows per request, parts.
type Shape = ((usize, usize, usize), &'static [usize], usize);

const SHAPES: [Shape; 7] = [
    ((1, 24, 8), &[0, 1, 17], 1),
    ((3, 48, 16), &[15, 16, 33, 100], 3),
    ((4, 0, 32), &[9, 40], 2),
    ((16, 40, 24), &[31, 2], 5),
    ((17, 448, 64), &[40, 5], 7),
    ((33, 104, 16), &[64, 1, 18], 132),
    ((64, 448, 64), &[70], 4),
];

#[test]
fn heads_batched_attention_is_within_its_bound_of_the_reference() {
    let mut rng = Rng::for_tensor(21, "emulate-attn-fp8");
    for (dims, counts, parts) in SHAPES {
        let c = case(&mut rng, dims, counts, parts);
        let w = worst(&c, &run(&c));
        assert!(
            w <= 1.0,
            "{dims:?} {counts:?} parts {parts}: {w} of the bound"
        );
    }
}

/// A request whose rows are all empty slots, or that has none, attends to its sink alone: 0.
#[test]
fn empty_requests_give_zero() {
    let mut rng = Rng::for_tensor(22, "emulate-attn-fp8-empty");
    let mut c = case(&mut rng, (5, 48, 16), &[3, 0, 20], 3);
    c.offsets[..3].fill(EMPTY_SLOT);
    let got = run(&c);
    let per = 5 * 64;
    assert!(got[..2 * per].iter().all(|&v| v == 0.0));
    assert!(got[2 * per..].iter().any(|&v| v != 0.0));
    assert!(worst(&c, &got) <= 1.0);
}

/// NaN in, NaN out: an undefined index choice or a NaN stored value poisons every head of its
/// request, a NaN sink its head, a NaN query value its head; the rest stays finite.
#[test]
fn a_nan_reaches_what_it_entered_and_nothing_else() {
    let mut rng = Rng::for_tensor(23, "emulate-attn-fp8-nan");
    let (heads, dim) = (18, 64);
    let per = heads * dim;
    let base = case(&mut rng, (heads, 48, 16), &[40, 33], 4);
    let check = |c: &Case, poisoned: &dyn Fn(usize, usize) -> bool, what: &str| {
        let got = run(c);
        assert!(
            !worst(c, &got).is_nan(),
            "{what}: NaN where the reference has none"
        );
        for b in 0..2 {
            for h in 0..heads {
                let head = &got[b * per + h * dim..b * per + (h + 1) * dim];
                if poisoned(b, h) {
                    assert!(
                        head.iter().all(|v| v.is_nan()),
                        "{what}: request {b} head {h}"
                    );
                } else {
                    assert!(
                        head.iter().all(|v| v.is_finite()),
                        "{what}: request {b} head {h}"
                    );
                }
            }
        }
    };
    let mut c = case(&mut rng, (heads, 48, 16), &[40, 33], 4);
    c.offsets[45] = -2;
    check(&c, &|b, _| b == 1, "an undefined choice");
    let mut c = base;
    let stored = c.offsets[11] as usize;
    c.pool[stored + 5] = 0x7F;
    check(&c, &|b, _| b == 0, "a NaN e4m3 value");
    c.pool[stored + 5] = 0;
    c.pool[stored + 48 + 32] = 0xFF;
    check(&c, &|b, _| b == 0, "a NaN scale");
    c.pool[stored + 48 + 32] = 120;
    c.sinks[7] = f32::NAN;
    check(&c, &|_, h| h == 7, "a NaN sink");
    c.sinks[7] = 0.0;
    c.q[per + 3 * dim + 9] = f32::NAN;
    check(&c, &|b, h| b == 1 && h == 3, "a NaN query");
}

/// Errors in the kernel's index math are caught: lanes swapped in either MMA, a register
/// pair swapped, scales read per 32 instead of 64, half of every score dropped.
#[test]
fn planted_errors_in_the_kernels_math_are_caught() {
    let mut rng = Rng::for_tensor(24, "emulate-attn-fp8-plants");
    let c = case(&mut rng, (17, 448, 64), &[40, 5], 7);
    let inputs = Inputs {
        q: &c.q,
        pool: &c.pool,
        row_offsets: &c.offsets,
        starts: &c.starts,
        sinks: &c.sinks,
        shape: &c.shape,
    };
    let run_with = |tamper: Tamper<'_>, plant: Plant| attn_with(&inputs, tamper, plant);
    assert!(worst(&c, &run_with(&|_, _| {}, Plant::None)) <= 1.0);
    let swap_a = |which: Mma| {
        move |mma: Mma, regs: &mut Regs| {
            if mma == which {
                regs.0.swap(1, 6);
            }
        }
    };
    let swap_b = |which: Mma| {
        move |mma: Mma, regs: &mut Regs| {
            if mma == which {
                for lane in &mut regs.1 {
                    lane.swap(0, 1);
                }
            }
        }
    };
    let plants: [Planted<'_>; 6] = [
        ("A lanes of the scores", &swap_a(Mma::Scores), Plant::None),
        ("A lanes of the output", &swap_a(Mma::Output), Plant::None),
        (
            "B registers of the scores",
            &swap_b(Mma::Scores),
            Plant::None,
        ),
        (
            "B registers of the output",
            &swap_b(Mma::Output),
            Plant::None,
        ),
        ("scale blocks of 32", &|_, _| {}, Plant::ScaleBlock),
        ("one half of the scores", &|_, _| {}, Plant::OneHalf),
    ];
    for (what, tamper, plant) in plants {
        let w = worst(&c, &run_with(tamper, plant));
        assert!(
            w.is_nan() || w > 1.0,
            "{what}: not caught ({w} of the bound)"
        );
    }
}
