//! How a kernel's outputs are held against its reference's where the arithmetic differs
//! (a stated bound per output).

/// The largest `|got - want| / bound(i)` over the outputs, NaN where exactly one of the two is
/// NaN (a NaN where the reference has a number, or the reverse, is never within a bound).
pub fn worst_ratio(got: &[f32], want: &[f32], bound: impl Fn(usize) -> f32) -> f32 {
    assert_eq!(got.len(), want.len(), "output lengths");
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g.is_nan() || w.is_nan() {
            if g.is_nan() != w.is_nan() {
                return f32::NAN;
            }
            continue;
        }
        worst = worst.max((g - w).abs() / bound(i));
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worst ratio over the outputs; a NaN on one side only is NaN (never within a
    /// bound), on both sides nothing.
    #[test]
    fn the_worst_ratio_and_a_one_sided_nan() {
        let bound = |_| 0.5;
        assert_eq!(
            worst_ratio(&[1.0, 2.0], &[1.25, 1.0], bound).to_bits(),
            2f32.to_bits()
        );
        assert_eq!(
            worst_ratio(&[f32::NAN, 2.0], &[f32::NAN, 2.0], bound).to_bits(),
            0f32.to_bits()
        );
        assert!(worst_ratio(&[f32::NAN, 2.0], &[1.0, 2.0], bound).is_nan());
        assert!(worst_ratio(&[1.0], &[f32::NAN], bound).is_nan());
    }
}
