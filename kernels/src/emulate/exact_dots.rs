//! `exact_gemv.cu` on the CPU: its groups of eight threads as the engine's eight lanes, each
//! thread's fused multiply-add chain over its elements, the three shuffles of the halving, and
//! the tail on the group's first thread. The tests compare its bits with the engine's
//! `dots_source` for every stored format, and show that a wrong halving order or a tail added
//! before the halving changes bits.

/// Rows per block (`GROUPS`), vectors per pass (`VB`).
const GROUPS: usize = crate::cuda_constants::exact_gemv::GROUPS;
const VB: usize = crate::cuda_constants::exact_gemv::VB;

/// A deliberate error, for the tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plant {
    None,
    /// Halving by 1, then 2, then 4.
    HalvingUpwards,
    /// The tail added to lane 0 before the halving.
    EarlyTail,
}

/// `__shfl_down_sync(v, delta, 8)` for all eight threads of a group, then `v + that`.
fn shuffle_add(lanes: &mut [f32; 8], delta: usize) {
    let before = *lanes;
    for (k, v) in lanes.iter_mut().enumerate() {
        let other = if k + delta < 8 {
            before[k + delta]
        } else {
            before[k]
        };
        *v += other;
    }
}

pub(super) fn exact_with(
    element: &dyn Fn(usize, usize) -> f32,
    cols: usize,
    (row0, rows): (usize, usize),
    x: &[f32],
    vectors: usize,
    plant: Plant,
) -> Vec<f32> {
    let mut y = vec![f32::NAN; vectors * rows];
    let chunks = cols / 8;
    for block in 0..rows.div_ceil(GROUPS) {
        for group in 0..GROUPS {
            let r = block * GROUPS + group;
            if r >= rows {
                continue;
            }
            let wr = row0 + r;
            for v0 in (0..vectors).step_by(VB) {
                let mut acc = [[0f32; 8]; VB];
                for k in 0..8 {
                    for i in 0..chunks {
                        let c = i * 8 + k;
                        let w = element(wr, c);
                        for (j, a) in acc.iter_mut().enumerate() {
                            if v0 + j < vectors {
                                a[k] = w.mul_add(x[(v0 + j) * cols + c], a[k]);
                            }
                        }
                    }
                }
                for (j, lanes) in acc.iter_mut().enumerate() {
                    if v0 + j >= vectors {
                        continue;
                    }
                    let xv = &x[(v0 + j) * cols..(v0 + j + 1) * cols];
                    let mut tail = 0f32;
                    for (c, &xc) in xv.iter().enumerate().skip(chunks * 8) {
                        tail = element(wr, c).mul_add(xc, tail);
                    }
                    if plant == Plant::EarlyTail {
                        lanes[0] += tail;
                        tail = 0.0;
                    }
                    let deltas = if plant == Plant::HalvingUpwards {
                        [1, 2, 4]
                    } else {
                        [4, 2, 1]
                    };
                    for delta in deltas {
                        shuffle_add(lanes, delta);
                    }
                    y[(v0 + j) * rows + r] = lanes[0] + tail;
                }
            }
        }
    }
    y
}

/// The outputs `exact_gemv_*` computes for rows `row0..row0 + rows` of a weight whose element
/// `(r, c)` decodes to `element(r, c)`, times `vectors` vectors of `cols` values; vector-major.
pub fn exact_dots(
    element: &dyn Fn(usize, usize) -> f32,
    cols: usize,
    rows: (usize, usize),
    x: &[f32],
    vectors: usize,
) -> Vec<f32> {
    exact_with(element, cols, rows, x, vectors, Plant::None)
}

#[cfg(test)]
mod tests {
    use engine::{
        synth::Rng,
        tensor::rows::{Bf16Rows, F32Rows, Fp8BlockRows, Mxfp4Rows, Nvfp4Rows, RowSource},
    };

    use super::*;
    use crate::cpu::engine_dots;

    fn element_of<S: RowSource>(src: &S) -> impl Fn(usize, usize) -> f32 + '_ {
        move |r, c| S::get(src.row(r), c)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Every stored format, awkward shapes (tails of 1 to 7, rows past a block, an offset
    /// into the weight, 1 to 9 vectors): the emulated kernel gives the engine's bits.
    #[test]
    fn the_kernels_lanes_give_the_engines_bits_in_every_format() {
        let mut rng = Rng::for_tensor(81, "emulate-exact-gemv");
        for (total_rows, cols, (row0, rows), vectors) in [
            (40usize, 13usize, (0usize, 40usize), 1usize),
            (70, 64, (5, 60), 9),
            (130, 135, (128, 2), 4),
            (33, 7, (1, 32), 5),
        ] {
            let x: Vec<f32> = (0..vectors * cols).map(|_| rng.normal()).collect();
            let f32s: Vec<f32> = (0..total_rows * cols).map(|_| rng.normal()).collect();
            let f32_rows = F32Rows {
                rows: |r: usize| &f32s[r * cols..(r + 1) * cols],
                cols,
            };
            let bf16: Vec<u8> = f32s
                .iter()
                .flat_map(|&v| engine::formats::f32_to_bf16(v).to_le_bytes())
                .collect();
            let bf16_rows = Bf16Rows { bytes: &bf16, cols };
            let codes: Vec<u8> = (0..total_rows * cols)
                .map(|_| {
                    (rng.next_u64() % 0x7E) as u8
                        | if rng.next_u64().is_multiple_of(2) {
                            0x80
                        } else {
                            0
                        }
                })
                .collect();
            let scales: Vec<f32> = (0..total_rows.div_ceil(128) * cols.div_ceil(128))
                .map(|i| 2f32.powi(i as i32 % 7 - 3))
                .collect();
            let fp8_rows = Fp8BlockRows {
                codes: &codes,
                scales: &scales,
                cols,
            };
            let what = format!("{total_rows}x{cols} rows {row0}+{rows} vectors {vectors}");
            let check = |name: &str, e: &dyn Fn(usize, usize) -> f32, want: Vec<f32>| {
                let got = exact_dots(e, cols, (row0, rows), &x, vectors);
                assert_eq!(bits(&got), bits(&want), "{name} {what}");
            };
            check(
                "f32",
                &element_of(&f32_rows),
                engine_dots(&f32_rows, (row0, rows), &x, vectors),
            );
            check(
                "bf16",
                &element_of(&bf16_rows),
                engine_dots(&bf16_rows, (row0, rows), &x, vectors),
            );
            check(
                "fp8",
                &element_of(&fp8_rows),
                engine_dots(&fp8_rows, (row0, rows), &x, vectors),
            );
            // FP4 formats need whole blocks of 16 / 32 values.
            let cols4 = cols.next_multiple_of(32);
            let x4: Vec<f32> = (0..vectors * cols4).map(|_| rng.normal()).collect();
            let packed: Vec<u8> = (0..total_rows * cols4 / 2)
                .map(|_| rng.next_u64() as u8)
                .collect();
            let nv_scales: Vec<u8> = (0..total_rows * cols4 / 16)
                .map(|_| (rng.next_u64() % 0x7E) as u8)
                .collect();
            let mx_scales: Vec<u8> = (0..total_rows * cols4 / 32)
                .map(|_| 120 + (rng.next_u64() % 14) as u8)
                .collect();
            let nv = Nvfp4Rows {
                packed: &packed,
                scales: &nv_scales,
                scale_2: 0.37,
                cols: cols4,
            };
            let mx = Mxfp4Rows {
                packed: &packed,
                scales: &mx_scales,
                cols: cols4,
            };
            for (name, e, want) in [
                (
                    "nvfp4",
                    &element_of(&nv) as &dyn Fn(usize, usize) -> f32,
                    engine_dots(&nv, (row0, rows), &x4, vectors),
                ),
                (
                    "mxfp4",
                    &element_of(&mx),
                    engine_dots(&mx, (row0, rows), &x4, vectors),
                ),
            ] {
                let got = exact_dots(e, cols4, (row0, rows), &x4, vectors);
                assert_eq!(bits(&got), bits(&want), "{name} {what}");
            }
        }
    }

    #[test]
    fn a_wrong_reduction_order_changes_bits() {
        let mut rng = Rng::for_tensor(82, "emulate-exact-gemv-plants");
        let (rows, cols, vectors) = (64usize, 203usize, 3usize);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.normal()).collect();
        let x: Vec<f32> = (0..vectors * cols).map(|_| rng.normal()).collect();
        let src = F32Rows {
            rows: |r: usize| &w[r * cols..(r + 1) * cols],
            cols,
        };
        let want = engine_dots(&src, (0, rows), &x, vectors);
        for plant in [Plant::HalvingUpwards, Plant::EarlyTail] {
            let got = exact_with(&element_of(&src), cols, (0, rows), &x, vectors, plant);
            assert_ne!(bits(&got), bits(&want), "{plant:?} not caught");
        }
    }
}
