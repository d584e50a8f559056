//! The two numeric pieces whose bits decide which token is drawn: the random stream and `exp`.
//!
//! Both are built from IEEE-754 basic operations only (add, sub, mul, div, round, bit casts),
//! which every conforming machine rounds identically. `f64::exp` is deliberately not used on
//! the sampling path: it calls the platform's libm, whose last-bit results differ between
//! libraries, and a one-ulp difference in a weight can flip a draw whose uniform lands on a
//! boundary. With these, the same seed gives the same tokens on any machine.

/// SplitMix64 (Steele, Lea, Flood 2014; Vigna's reference `splitmix64.c`): a fully specified
/// 64-bit generator with one word of state, so a request's stream is reproducible from its seed
/// alone and its position is simply "how many words were drawn".
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform in `[0, 1)` from the top 53 bits of one word: every value is an exact multiple
    /// of 2^-53, so the mapping has no rounding at all.
    pub(crate) fn next_uniform(&mut self) -> f64 {
        const SCALE: f64 = 1.0 / (1u64 << 53) as f64;
        (self.next_u64() >> 11) as f64 * SCALE
    }
}

/// Below this, `exp` is under 2^-1021 relative to the best token's weight of 1: such a token can
/// never be drawn in practice, and returning exactly 0 keeps the scaling below out of the
/// subnormal range.
const EXP_CUTOFF: f64 = -708.0;

/// `exp(x)` for `x <= 0`, deterministic to the bit on every IEEE-754 machine, accurate to a few
/// ulp. Sampling weights are `exp((logit - max) / temperature)`, so the argument is never
/// positive; positive inputs are clamped to 0 (weight 1) rather than overflowing.
pub(crate) fn exp_nonpositive(x: f64) -> f64 {
    // Cody-Waite split of ln 2: the high part has trailing zero bits so `k * LN2_HI` is exact.
    const LN2_HI: f64 = 0.693_147_180_369_123_8;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    if x.is_nan() || x < EXP_CUTOFF {
        return 0.0;
    }
    let x = x.min(0.0);
    // x = k ln2 + r with |r| <= ln2 / 2, so exp(x) = 2^k exp(r).
    let k = (x * std::f64::consts::LOG2_E).round();
    let r = (x - k * LN2_HI) - k * LN2_LO;
    // Taylor series to degree 13: the remainder |r|^14 / 14! < 2e-17 for |r| <= 0.347.
    let mut poly = 1.0;
    for n in (1..=13).rev() {
        poly = 1.0 + poly * r / f64::from(n);
    }
    // k is in [-1022, 0] here, so 2^k is a normal f64 built directly from its exponent bits.
    let scale = f64::from_bits(((k as i64 + 1023) as u64) << 52);
    poly * scale
}
