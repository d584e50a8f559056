//! Per-request token sampling with vLLM / OpenAI semantics: logit bias, repetition / frequency /
//! presence penalties, `min_tokens` suppression of stop ids, log-probabilities, then greedy or
//! temperature + top-k + top-p + min-p sampling from the request's own seeded random stream.
//!
//! A [`Sampler`] belongs to exactly one request and sees only that request's logits row, prompt
//! and generated tokens, so its output never depends on batch composition, thread timing or
//! other requests. Everything that decides the drawn token is specified to the bit: candidates
//! are ordered by (logit descending, token id ascending), which is a total order, weights use a
//! libm-free `exp` (see the private `math` module), sums run in f64 in that fixed order, and the random stream is
//! SplitMix64. The same seed, prompt, parameters and logits therefore give the same tokens on
//! any machine.
//!
//! Each step, in order:
//! 1. copy the logits; non-finite entries (NaN, ±inf) count as masked (-inf) and stay masked;
//!    add `logit_bias`;
//! 2. repetition penalty over prompt ∪ generated (`l > 0 → l / p`, else `l * p`);
//! 3. frequency / presence penalties over generated tokens;
//! 4. with an output constraint (structured outputs, [`crate::grammar`]), mask every token its
//!    grammar does not allow; then, until `min_tokens` tokens exist, mask stop ids and (unless
//!    `ignore_eos`) eos ids, unless that would leave nothing;
//! 5. log-probabilities = log_softmax of these processed logits (before temperature);
//! 6. greedy argmax at temperature 0, else temperature, top-k, top-p, min-p and one draw;
//! 7. record the token (and advance the constraint over it). A complete grammar ends the
//!    request like a stop id, `ignore_eos` or not: nothing may follow it.
//!
//! A processed logit that overflows f32 (e.g. a huge logit divided by a tiny repetition penalty)
//! saturates at ±`f32::MAX` instead of becoming infinite, so a token that was finite stays
//! sampleable and the arithmetic below never meets `inf - inf`.

mod math;
#[cfg(test)]
mod tests;

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};

use math::{SplitMix64, exp_nonpositive};

use crate::grammar::{GrammarError, TokenConstraint};

/// Most `top_logprobs` a request may ask for (the OpenAI limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// The request vocabulary is defined once, in `proto` (with its wire conversions).
pub use proto::request::{
    FinishReason, Grammar, OutputConstraint, Sampled, SamplingParams, StopConditions,
};

/// Invalid parameters or inputs; nothing in this module panics instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SamplingError {
    #[error("`{name}` = {value} is out of range: accepted {accepted}")]
    OutOfRange {
        name: &'static str,
        value: String,
        accepted: &'static str,
    },
    #[error("`{name}` holds token {token}, outside the vocabulary of {vocab_size} tokens")]
    TokenOutOfVocab {
        name: &'static str,
        token: u32,
        vocab_size: usize,
    },
    #[error("logits row has {actual} entries but the vocabulary has {expected}")]
    LogitsLength { expected: usize, actual: usize },
    #[error("no finite logit remains to sample from")]
    NoFiniteLogit,
    #[error("the request already finished ({0:?}); no further token may be sampled")]
    Finished(FinishReason),
    #[error("this request's next token is not the argmax of its logits as they come")]
    NotArgmax,
    #[error(transparent)]
    Constraint(#[from] GrammarError),
}

fn out_of_range(
    name: &'static str,
    value: impl std::fmt::Display,
    accepted: &'static str,
) -> SamplingError {
    SamplingError::OutOfRange {
        name,
        value: value.to_string(),
        accepted,
    }
}

/// Checks every parameter against its documented range. NaN fails every range check, because
/// `RangeInclusive::contains` and the explicit comparisons are all false for NaN.
fn validate(
    params: &SamplingParams,
    stop: &StopConditions,
    vocab_size: usize,
) -> Result<(), SamplingError> {
    // Token ids are u32, so a larger vocabulary could not be addressed.
    if vocab_size == 0 || vocab_size as u64 > u64::from(u32::MAX) + 1 {
        return Err(out_of_range("vocab_size", vocab_size, "[1, 2^32]"));
    }
    let p = params;
    if !(0.0..=2.0).contains(&p.temperature) {
        return Err(out_of_range("temperature", p.temperature, "[0, 2]"));
    }
    if !(p.top_p > 0.0 && p.top_p <= 1.0) {
        return Err(out_of_range("top_p", p.top_p, "(0, 1]"));
    }
    if !(0.0..=1.0).contains(&p.min_p) {
        return Err(out_of_range("min_p", p.min_p, "[0, 1]"));
    }
    if !(-2.0..=2.0).contains(&p.presence_penalty) {
        return Err(out_of_range(
            "presence_penalty",
            p.presence_penalty,
            "[-2, 2]",
        ));
    }
    if !(-2.0..=2.0).contains(&p.frequency_penalty) {
        return Err(out_of_range(
            "frequency_penalty",
            p.frequency_penalty,
            "[-2, 2]",
        ));
    }
    if !(p.repetition_penalty > 0.0 && p.repetition_penalty <= 2.0) {
        return Err(out_of_range(
            "repetition_penalty",
            p.repetition_penalty,
            "(0, 2]",
        ));
    }
    if p.top_logprobs > MAX_TOP_LOGPROBS {
        return Err(out_of_range("top_logprobs", p.top_logprobs, "[0, 20]"));
    }
    if let Some(k) = p.prompt_logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
        return Err(out_of_range("prompt_logprobs", k, "[0, 20]"));
    }
    for &(token, bias) in &p.logit_bias {
        if token as usize >= vocab_size {
            return Err(SamplingError::TokenOutOfVocab {
                name: "logit_bias",
                token,
                vocab_size,
            });
        }
        if !(-100.0..=100.0).contains(&bias) {
            return Err(out_of_range(
                "logit_bias",
                format!("{bias} (token {token})"),
                "[-100, 100]",
            ));
        }
    }
    if stop.max_tokens == 0 {
        return Err(out_of_range("max_tokens", 0, ">= 1"));
    }
    if stop.min_tokens > stop.max_tokens {
        return Err(out_of_range(
            "min_tokens",
            stop.min_tokens,
            "[0, max_tokens]",
        ));
    }
    Ok(())
}

/// Sorted, deduplicated ids below `vocab_size`, for binary search.
fn id_set(ids: impl IntoIterator<Item = u32>, vocab_size: usize) -> Vec<u32> {
    let mut v: Vec<u32> = ids
        .into_iter()
        .filter(|&t| (t as usize) < vocab_size)
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Keeps a processed logit finite: overflow saturates instead of turning into ±inf.
fn saturate(x: f32) -> f32 {
    x.clamp(-f32::MAX, f32::MAX)
}

/// The candidate order used everywhere: logit descending, then token id ascending. It is total
/// (ids are unique and only finite logits are compared), so sorts and selections give the same
/// result whatever the algorithm. Probability is monotone in the logit, so this is also the
/// "probability descending" order. `partial_cmp`, not `total_cmp`, so that -0.0 and 0.0 tie
/// and fall to the id, exactly as in the greedy argmax.
fn by_rank(a: (u32, f32), b: (u32, f32)) -> Ordering {
    b.1.partial_cmp(&a.1)
        .unwrap_or(Ordering::Equal)
        .then(a.0.cmp(&b.0))
}

/// The `n` best candidates in rank order.
fn best_n(mut cands: Vec<(u32, f32)>, n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    if n < cands.len() {
        cands.select_nth_unstable_by(n - 1, |a, b| by_rank(*a, *b));
        cands.truncate(n);
    }
    cands.sort_unstable_by(|a, b| by_rank(*a, *b));
    cands
}

/// Token sampling state of one request.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    stop: StopConditions,
    vocab_size: usize,
    seed: u64,
    rng: SplitMix64,
    /// Stop ids plus (unless `ignore_eos`) eos ids, in range, sorted: what ends the request and
    /// what `min_tokens` suppresses.
    stop_set: Vec<u32>,
    generated: Vec<u32>,
    /// Occurrences of each generated token, for frequency / presence penalties.
    counts: BTreeMap<u32, u32>,
    /// Prompt ∪ generated, for the repetition penalty; left empty when the penalty is disabled
    /// so long prompts cost nothing.
    seen: BTreeSet<u32>,
    /// The compiled grammar of `params.constraint`, when there is one.
    constraint: Option<TokenConstraint>,
}

impl Sampler {
    /// Validates everything up front so `sample` can only fail on its own input.
    pub fn new(
        params: SamplingParams,
        stop: StopConditions,
        prompt: &[u32],
        vocab_size: usize,
        default_seed: u64,
    ) -> Result<Self, SamplingError> {
        validate(&params, &stop, vocab_size)?;
        if let Some(&token) = prompt.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(SamplingError::TokenOutOfVocab {
                name: "prompt",
                token,
                vocab_size,
            });
        }
        let eos = if stop.ignore_eos {
            &[][..]
        } else {
            &stop.eos_token_ids[..]
        };
        let stop_set = id_set(stop.stop_token_ids.iter().chain(eos).copied(), vocab_size);
        #[allow(
            clippy::float_cmp,
            reason = "1 is exactly the documented 'disabled' value"
        )]
        let seen = if params.repetition_penalty == 1.0 {
            BTreeSet::new()
        } else {
            prompt.iter().copied().collect()
        };
        let seed = params.seed.unwrap_or(default_seed);
        Ok(Self {
            params,
            stop,
            vocab_size,
            seed,
            rng: SplitMix64::new(seed),
            stop_set,
            generated: Vec::new(),
            counts: BTreeMap::new(),
            seen,
            constraint: None,
        })
    }

    /// Applies a compiled output constraint from the next token on (call before any token
    /// is sampled or resumed).
    #[must_use]
    pub fn constrained(mut self, constraint: TokenConstraint) -> Self {
        self.constraint = Some(constraint);
        self
    }

    /// The seed in use: `params.seed`, or the default seed the engine supplied.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Tokens sampled so far.
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Whether the request is finished after the last sampled token. A stop / eos id takes
    /// precedence over the length limit when both apply (as in vLLM).
    pub fn finish(&self) -> Option<FinishReason> {
        let &last = self.generated.last()?;
        let n = self.generated.len();
        if self
            .constraint
            .as_ref()
            .is_some_and(TokenConstraint::is_complete)
        {
            return Some(FinishReason::Stop);
        }
        if n >= self.stop.min_tokens as usize && self.stop_set.binary_search(&last).is_ok() {
            return Some(FinishReason::Stop);
        }
        if n >= self.stop.max_tokens as usize {
            return Some(FinishReason::Length);
        }
        None
    }

    /// Takes over a request whose first tokens were sampled elsewhere (a prefill worker): the
    /// random stream advances once per token, exactly as if this sampler had drawn them, and
    /// the tokens count for penalties and stop conditions.
    pub fn resume(&mut self, tokens: &[u32]) -> Result<(), SamplingError> {
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(SamplingError::TokenOutOfVocab {
                name: "generated",
                token,
                vocab_size: self.vocab_size,
            });
        }
        for &token in tokens {
            if let Some(reason) = self.finish() {
                return Err(SamplingError::Finished(reason));
            }
            if let Some(c) = self.constraint.as_mut() {
                c.consume(token)?;
            }
            let _ = self.rng.next_uniform();
            self.record(token);
        }
        Ok(())
    }

    /// Samples the next token from one logits row and records it.
    ///
    /// The random stream advances exactly once per sampled token, in greedy mode too (where the
    /// word is drawn and unused): the stream position then always equals `generated().len()`,
    /// so a request's state is reconstructible from its seed and its tokens alone (e.g. when a
    /// decode worker takes over from a prefill worker). On error nothing is recorded and the
    /// stream does not advance.
    pub fn sample(&mut self, logits: &[f32]) -> Result<Sampled, SamplingError> {
        if let Some(reason) = self.finish() {
            return Err(SamplingError::Finished(reason));
        }
        if logits.len() != self.vocab_size {
            return Err(SamplingError::LogitsLength {
                expected: self.vocab_size,
                actual: logits.len(),
            });
        }
        let mut processed = self.adjusted(logits);
        if let Some(c) = self.constraint.as_mut() {
            c.mask(&mut processed)?;
        }
        self.suppress_stops(&mut processed);
        let cands = finite_candidates(&processed)?;
        let u = self.rng.next_uniform();
        let lse = self.params.logprobs.then(|| log_sum_exp(&cands));
        let top_logprobs = lse.map_or_else(Vec::new, |lse| {
            ranked_logprobs(&cands, lse, self.params.top_logprobs as usize)
        });
        let token = if self.params.temperature == 0.0 {
            greedy(&cands)
        } else {
            self.draw(cands, u)
        };
        let logprob = lse.map(|lse| logprob_of(processed.get(token as usize).copied(), lse));
        if let Some(c) = self.constraint.as_mut() {
            c.consume_sampled(token)?;
        }
        self.record(token);
        Ok(Sampled {
            token,
            logprob,
            top_logprobs,
        })
    }

    /// Whether the next token is the argmax of the logits as they come (ties to the lowest
    /// id), when they are all finite: greedy, no log-probabilities, and no bias, penalty,
    /// constraint or stop suppression between the logits and the choice. A device can then
    /// send back the argmax alone ([`Self::take_argmax`]).
    #[allow(
        clippy::float_cmp,
        reason = "0 and 1 are exactly the documented 'disabled' values"
    )]
    pub fn takes_argmax(&self) -> bool {
        let p = &self.params;
        p.temperature == 0.0
            && !p.logprobs
            && p.logit_bias.is_empty()
            && p.frequency_penalty == 0.0
            && p.presence_penalty == 0.0
            && p.repetition_penalty == 1.0
            && self.seen.is_empty()
            && self.constraint.is_none()
            && (self.generated.len() >= self.stop.min_tokens as usize || self.stop_set.is_empty())
    }

    /// Takes `token`, the argmax of logits that were all finite, as [`Self::sample`] would
    /// have chosen it from them when [`Self::takes_argmax`] holds: the same result and the
    /// same state after (the random stream advances once, as it does for a greedy draw).
    pub fn take_argmax(&mut self, token: u32) -> Result<Sampled, SamplingError> {
        if let Some(reason) = self.finish() {
            return Err(SamplingError::Finished(reason));
        }
        if !self.takes_argmax() {
            return Err(SamplingError::NotArgmax);
        }
        if token as usize >= self.vocab_size {
            return Err(SamplingError::TokenOutOfVocab {
                name: "argmax",
                token,
                vocab_size: self.vocab_size,
            });
        }
        let _ = self.rng.next_uniform();
        self.record(token);
        Ok(Sampled {
            token,
            logprob: None,
            top_logprobs: Vec::new(),
        })
    }

    /// Steps 1-4 without a constraint: the logits every later step sees. Masked tokens are
    /// -inf, all others finite.
    #[cfg(test)]
    fn process(&self, logits: &[f32]) -> Vec<f32> {
        let mut out = self.adjusted(logits);
        self.suppress_stops(&mut out);
        out
    }

    /// Steps 1-3.
    fn adjusted(&self, logits: &[f32]) -> Vec<f32> {
        let mut out: Vec<f32> = logits
            .iter()
            .map(|&l| if l.is_finite() { l } else { f32::NEG_INFINITY })
            .collect();
        // `get_mut` everywhere: ids were validated against the vocabulary and the row length
        // checked, but a missing entry must never become a panic.
        let mut adjust = |token: u32, f: &dyn Fn(f32) -> f32| {
            if let Some(l) = out.get_mut(token as usize).filter(|l| l.is_finite()) {
                *l = saturate(f(*l));
            }
        };
        for &(token, bias) in &self.params.logit_bias {
            adjust(token, &|l| l + bias);
        }
        let rep = self.params.repetition_penalty;
        for &token in &self.seen {
            adjust(token, &|l| if l > 0.0 { l / rep } else { l * rep });
        }
        let (freq, pres) = (self.params.frequency_penalty, self.params.presence_penalty);
        if freq != 0.0 || pres != 0.0 {
            for (&token, &count) in &self.counts {
                // `count > 0` always holds for a recorded token, hence the plain `+ pres`.
                adjust(token, &|l| l - (freq * count as f32 + pres));
            }
        }
        out
    }

    /// Step 4's `min_tokens` part.
    fn suppress_stops(&self, out: &mut [f32]) {
        if self.generated.len() < self.stop.min_tokens as usize && !self.stop_set.is_empty() {
            let other_remains = out
                .iter()
                .enumerate()
                .any(|(i, l)| l.is_finite() && self.stop_set.binary_search(&(i as u32)).is_err());
            if other_remains {
                for &token in &self.stop_set {
                    if let Some(l) = out.get_mut(token as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }

    /// Step 6 for temperature > 0: `cands` are the finite processed logits, `u` the step's
    /// uniform in [0, 1).
    fn draw(&self, cands: Vec<(u32, f32)>, u: f64) -> u32 {
        let k = match self.params.top_k {
            0 => cands.len(),
            k => (k as usize).min(cands.len()),
        };
        let ranked = best_n(cands, k);
        let Some(&(best, max)) = ranked.first() else {
            // Unreachable: the caller passes at least one candidate and k >= 1.
            return 0;
        };
        // Unnormalised probabilities exp((l - max) / T): the best weighs exactly 1, the rest are
        // non-increasing in rank order. f64 so that neither the difference nor the division by a
        // tiny temperature can overflow.
        let temperature = f64::from(self.params.temperature);
        let mut weights: Vec<f64> = ranked
            .iter()
            .map(|&(_, l)| exp_nonpositive((f64::from(l) - f64::from(max)) / temperature))
            .collect();
        // Tokens with weight exactly 0 can never be drawn; dropping them changes no outcome.
        weights.truncate(weights.partition_point(|&w| w > 0.0));
        if self.params.top_p < 1.0 {
            let target = f64::from(self.params.top_p) * weights.iter().sum::<f64>();
            let mut cum = 0.0;
            // Smallest prefix reaching the mass; the first token always stays.
            let keep = weights
                .iter()
                .position(|&w| {
                    cum += w;
                    cum >= target
                })
                .map_or(weights.len(), |i| i + 1);
            weights.truncate(keep);
        }
        if self.params.min_p > 0.0 {
            // Relative to the best token, whose weight is 1, so no normalisation is needed; the
            // best itself always passes because min_p <= 1.
            let floor = f64::from(self.params.min_p);
            weights.truncate(weights.partition_point(|&w| w >= floor).max(1));
        }
        // Renormalising is folded into scaling the uniform by the kept mass. The walk sums in
        // the same order as `total`, so `target < total` guarantees a pick inside the loop.
        let total: f64 = weights.iter().sum();
        let target = u * total;
        let mut cum = 0.0;
        for (&(token, _), &w) in ranked.iter().zip(&weights) {
            cum += w;
            if target < cum {
                return token;
            }
        }
        ranked
            .get(weights.len().saturating_sub(1))
            .map_or(best, |&(t, _)| t)
    }

    /// Step 7.
    fn record(&mut self, token: u32) {
        self.generated.push(token);
        *self.counts.entry(token).or_insert(0) += 1;
        #[allow(
            clippy::float_cmp,
            reason = "1 is exactly the documented 'disabled' value"
        )]
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(token);
        }
    }
}

/// The id of the largest value of a logits row, ties to the lowest id (what greedy sampling
/// picks from finite logits), or the index of its first value that is not finite (or 0 for an
/// empty row). The reference of a device's argmax (`argmax_rows`).
pub fn argmax(row: &[f32]) -> Result<u32, usize> {
    if let Some(at) = row.iter().position(|v| !v.is_finite()) {
        return Err(at);
    }
    if row.is_empty() {
        return Err(0);
    }
    Ok(first_max(
        row.iter().enumerate().map(|(i, &v)| (i as u32, v)),
    ))
}

/// Argmax with ties to the lowest id: `cands` is in id order and only a strictly larger logit
/// replaces the current best.
fn greedy(cands: &[(u32, f32)]) -> u32 {
    first_max(cands.iter().copied())
}

/// The id of the first largest value of `(id, value)`s in id order (0 when there are none):
/// the one tie rule of greedy sampling and of the device's argmax.
fn first_max(cands: impl IntoIterator<Item = (u32, f32)>) -> u32 {
    let mut cands = cands.into_iter();
    let Some(mut best) = cands.next() else {
        return 0;
    };
    for c in cands {
        if c.1 > best.1 {
            best = c;
        }
    }
    best.0
}

/// Step 5: log_softmax of the processed logits (the finite `cands`) is `l - lse`. Computed in
/// f64 around the maximum, so no term overflows. The reported values use libm `exp`/`ln`; they
/// do not influence which token is drawn.
fn log_sum_exp(cands: &[(u32, f32)]) -> f64 {
    let max = cands
        .iter()
        .map(|&(_, l)| f64::from(l))
        .fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = cands.iter().map(|&(_, l)| (f64::from(l) - max).exp()).sum();
    max + sum.ln()
}

fn logprob_of(processed: Option<f32>, lse: f64) -> f32 {
    processed.map_or(f32::NEG_INFINITY, |l| (f64::from(l) - lse) as f32)
}

/// The (id, logit) pairs of a row's finite logits; a row with none is an error. Ids fit in
/// u32: `Sampler::new` bounds the vocabulary at 2^32.
fn finite_candidates(logits: &[f32]) -> Result<Vec<(u32, f32)>, SamplingError> {
    let cands: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_finite())
        .map(|(i, &l)| (i as u32, l))
        .collect();
    if cands.is_empty() {
        return Err(SamplingError::NoFiniteLogit);
    }
    Ok(cands)
}

/// A prompt token's entry: `token`'s log-probability under the raw model distribution of
/// `logits` (the row computed at the position before it: no bias, penalty, mask or
/// temperature) and the `top` best alternatives. Non-finite logits have no probability, as in
/// [`Sampler::sample`]; a row with none finite is an error.
pub fn prompt_logprob(logits: &[f32], token: u32, top: usize) -> Result<Sampled, SamplingError> {
    let cands = finite_candidates(logits)?;
    let lse = log_sum_exp(&cands);
    let own = logits
        .get(token as usize)
        .copied()
        .filter(|l| l.is_finite());
    Ok(Sampled {
        token,
        logprob: Some(logprob_of(own, lse)),
        top_logprobs: ranked_logprobs(&cands, lse, top),
    })
}

/// The `n` best (token, logprob) pairs in rank order.
fn ranked_logprobs(cands: &[(u32, f32)], lse: f64, n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    best_n(cands.to_vec(), n)
        .into_iter()
        .map(|(t, l)| (t, logprob_of(Some(l), lse)))
        .collect()
}
