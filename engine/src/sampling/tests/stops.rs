//! Stop conditions (EOS, stop ids, min and max tokens), refused parameters and logits, the
//! sampler over any accepted parameters, and the argmax shortcut against greedy sampling.

use super::*;

fn stops(max_tokens: u32, min_tokens: u32, ignore_eos: bool) -> StopConditions {
    StopConditions {
        max_tokens,
        min_tokens,
        stop_token_ids: vec![3],
        ignore_eos,
        eos_token_ids: vec![2],
    }
}

/// A row whose argmax is `token`.
fn favour(token: usize) -> Vec<f32> {
    let mut row = vec![0.0; 5];
    row[token] = 10.0;
    row
}

#[test]
fn eos_and_stop_ids_finish_with_stop() {
    for id in [2, 3] {
        let mut s =
            Sampler::new(SamplingParams::default(), stops(10, 0, false), &[], 5, 0).unwrap();
        s.sample(&favour(0)).unwrap();
        assert_eq!(s.finish(), None);
        s.sample(&favour(id)).unwrap();
        assert_eq!(s.finish(), Some(FinishReason::Stop));
        assert_eq!(
            s.sample(&favour(0)),
            Err(SamplingError::Finished(FinishReason::Stop))
        );
    }
}

#[test]
fn ignore_eos_continues_past_eos_but_not_stop_ids() {
    let mut s = Sampler::new(SamplingParams::default(), stops(10, 0, true), &[], 5, 0).unwrap();
    s.sample(&favour(2)).unwrap();
    assert_eq!(s.finish(), None);
    s.sample(&favour(3)).unwrap();
    assert_eq!(s.finish(), Some(FinishReason::Stop));
}

#[test]
fn min_tokens_masks_stop_ids_until_reached() {
    let mut s = Sampler::new(SamplingParams::default(), stops(10, 2, false), &[], 5, 0).unwrap();
    let mut row = favour(2);
    row[3] = 9.0;
    row[4] = 1.0;
    assert_eq!(s.sample(&row).unwrap().token, 4);
    assert_eq!(s.sample(&row).unwrap().token, 4);
    assert_eq!(s.finish(), None);
    assert_eq!(s.sample(&row).unwrap().token, 2);
    assert_eq!(s.finish(), Some(FinishReason::Stop));
    // With ignore_eos the eos id is not suppressed (it cannot stop anyway).
    let mut s = Sampler::new(SamplingParams::default(), stops(10, 2, true), &[], 5, 0).unwrap();
    assert_eq!(s.sample(&row).unwrap().token, 2);
}

#[test]
fn min_tokens_mask_is_skipped_when_it_would_leave_nothing() {
    let mut s = Sampler::new(SamplingParams::default(), stops(10, 3, false), &[], 5, 0).unwrap();
    let row = [
        f32::NEG_INFINITY,
        f32::NEG_INFINITY,
        1.0,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    assert_eq!(s.sample(&row).unwrap().token, 2);
    // Below min_tokens the eos id does not stop the request.
    assert_eq!(s.finish(), None);
}

#[test]
fn max_tokens_finishes_with_length_and_stop_wins_ties() {
    let mut s = Sampler::new(SamplingParams::default(), stops(2, 0, false), &[], 5, 0).unwrap();
    s.sample(&favour(0)).unwrap();
    assert_eq!(s.finish(), None);
    s.sample(&favour(1)).unwrap();
    assert_eq!(s.finish(), Some(FinishReason::Length));
    assert_eq!(s.generated(), &[0, 1]);
    let mut s = Sampler::new(SamplingParams::default(), stops(1, 0, false), &[], 5, 0).unwrap();
    s.sample(&favour(3)).unwrap();
    assert_eq!(s.finish(), Some(FinishReason::Stop));
}

fn rejected(params: SamplingParams, vocab: usize) -> SamplingError {
    Sampler::new(params, stop(10), &[], vocab, 0).unwrap_err()
}

fn assert_names(err: &SamplingError, name: &str, accepted: &str) {
    let msg = err.to_string();
    assert!(msg.contains(name) && msg.contains(accepted), "{msg}");
}

#[test]
fn invalid_parameters_name_the_parameter_and_range() {
    let p = SamplingParams::default;
    let cases = [
        (
            SamplingParams {
                temperature: f32::NAN,
                ..p()
            },
            "temperature",
            "[0, 2]",
        ),
        (
            SamplingParams {
                temperature: 2.5,
                ..p()
            },
            "temperature",
            "[0, 2]",
        ),
        (
            SamplingParams {
                temperature: -0.1,
                ..p()
            },
            "temperature",
            "[0, 2]",
        ),
        (SamplingParams { top_p: 0.0, ..p() }, "top_p", "(0, 1]"),
        (
            SamplingParams {
                top_p: f32::NAN,
                ..p()
            },
            "top_p",
            "(0, 1]",
        ),
        (SamplingParams { min_p: 1.5, ..p() }, "min_p", "[0, 1]"),
        (
            SamplingParams {
                presence_penalty: 2.1,
                ..p()
            },
            "presence_penalty",
            "[-2, 2]",
        ),
        (
            SamplingParams {
                frequency_penalty: -3.0,
                ..p()
            },
            "frequency_penalty",
            "[-2, 2]",
        ),
        (
            SamplingParams {
                repetition_penalty: 0.0,
                ..p()
            },
            "repetition_penalty",
            "(0, 2]",
        ),
        (
            SamplingParams {
                top_logprobs: 21,
                ..p()
            },
            "top_logprobs",
            "[0, 20]",
        ),
        (
            SamplingParams {
                logit_bias: vec![(1, 101.0)],
                ..p()
            },
            "logit_bias",
            "[-100, 100]",
        ),
        (
            SamplingParams {
                logit_bias: vec![(1, f32::NAN)],
                ..p()
            },
            "logit_bias",
            "[-100, 100]",
        ),
    ];
    for (params, name, accepted) in cases {
        let err = rejected(params, 8);
        assert!(
            matches!(err, SamplingError::OutOfRange { name: n, .. } if n == name),
            "{err}"
        );
        assert_names(&err, name, accepted);
    }
    let err = rejected(
        SamplingParams {
            logit_bias: vec![(8, 1.0)],
            ..p()
        },
        8,
    );
    assert_eq!(
        err,
        SamplingError::TokenOutOfVocab {
            name: "logit_bias",
            token: 8,
            vocab_size: 8
        }
    );
    assert_names(&err, "logit_bias", "8 tokens");
    assert!(Sampler::new(p(), stop(10), &[1, 9], 8, 0).is_err());
    assert_names(
        &Sampler::new(p(), stop(0), &[], 8, 0).unwrap_err(),
        "max_tokens",
        ">= 1",
    );
    let mut bad = stop(2);
    bad.min_tokens = 3;
    assert_names(
        &Sampler::new(p(), bad, &[], 8, 0).unwrap_err(),
        "min_tokens",
        "max_tokens",
    );
    assert_names(&rejected(p(), 0), "vocab_size", "[1, 2^32]");
    // The boundaries themselves are accepted.
    let edge = SamplingParams {
        temperature: 2.0,
        top_p: 1.0,
        min_p: 1.0,
        presence_penalty: -2.0,
        frequency_penalty: 2.0,
        repetition_penalty: 2.0,
        top_logprobs: 20,
        logit_bias: vec![(0, -100.0), (7, 100.0)],
        ..p()
    };
    assert!(Sampler::new(edge, stop(1), &[], 8, 0).is_ok());
}

#[test]
fn bad_logits_are_errors_and_change_nothing() {
    let mut s = sampler(random(1.0, 5), 4);
    let fresh = s.clone();
    assert_eq!(
        s.sample(&[0.0; 3]),
        Err(SamplingError::LogitsLength {
            expected: 4,
            actual: 3
        })
    );
    assert_eq!(
        s.sample(&[f32::NAN, f32::NEG_INFINITY, f32::INFINITY, f32::NAN]),
        Err(SamplingError::NoFiniteLogit)
    );
    assert_eq!((s.rng.clone(), s.generated().len()), (fresh.rng, 0));
}

/// Parameters anywhere in their accepted ranges, boundaries included.
fn any_params(vocab: usize) -> impl Strategy<Value = SamplingParams> {
    let unit = || prop_oneof![Just(0.0f32), Just(1.0f32), 0.0f32..=1.0];
    (
        prop_oneof![Just(0.0f32), Just(1e-30f32), Just(2.0f32), 0.0f32..=2.0],
        prop_oneof![
            Just(1.0f32),
            Just(1e-30f32),
            (0.0f32..=1.0).prop_filter("> 0", |p| *p > 0.0)
        ],
        prop_oneof![
            Just(0u32),
            Just(1u32),
            0u32..=(vocab as u32 + 2),
            Just(u32::MAX)
        ],
        unit(),
        any::<Option<u64>>(),
        (-2.0f32..=2.0, -2.0f32..=2.0),
        prop_oneof![Just(1.0f32), Just(2.0f32), Just(1e-30f32), 1e-3f32..=2.0],
        prop::collection::vec((0..vocab as u32, -100.0f32..=100.0), 0..4),
        (any::<bool>(), 0u32..=20),
    )
        .prop_map(
            |(temperature, top_p, top_k, min_p, seed, (pres, freq), rep, bias, (lp, top))| {
                SamplingParams {
                    temperature,
                    top_p,
                    top_k,
                    min_p,
                    seed,
                    presence_penalty: pres,
                    frequency_penalty: freq,
                    repetition_penalty: rep,
                    logit_bias: bias,
                    logprobs: lp,
                    top_logprobs: top,
                    constraint: None,
                    prompt_logprobs: None,
                }
            },
        )
}

fn any_logit() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -30.0f32..30.0,
        1 => Just(f32::MAX),
        1 => Just(-f32::MAX),
        1 => -1e30f32..1e30,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_valid_inputs_always_yield_a_finite_in_vocab_token(
        (vocab, params, prompt, rows, eos, min_tokens) in (1usize..40).prop_flat_map(|vocab| (
            Just(vocab),
            any_params(vocab),
            prop::collection::vec(0..vocab as u32, 0..8),
            prop::collection::vec(prop::collection::vec(any_logit(), vocab), 1..12),
            prop::collection::vec(0..vocab as u32 + 2, 0..3),
            0u32..12,
        )),
        ignore_eos in any::<bool>(),
    ) {
        let stop = StopConditions {
            max_tokens: 12,
            min_tokens,
            stop_token_ids: eos.iter().map(|t| t + 1).collect(),
            ignore_eos,
            eos_token_ids: eos,
        };
        let mut s = Sampler::new(params.clone(), stop, &prompt, vocab, 1).unwrap();
        for row in &rows {
            if s.finish().is_some() {
                break;
            }
            let processed = s.process(row);
            let out = s.sample(row).unwrap();
            prop_assert!((out.token as usize) < vocab);
            prop_assert!(processed[out.token as usize].is_finite());
            if params.logprobs {
                prop_assert!(out.logprob.is_some_and(|l| l <= 0.0 && !l.is_nan()));
                prop_assert!(out.top_logprobs.len() <= params.top_logprobs as usize);
            }
        }
    }
}

/// Where `takes_argmax` holds, the argmax of the logits is what `sample` picks, and taking it
/// leaves the sampler as sampling does (the next draws agree too), over random rows with ties
/// and signed zeros; where it does not hold (log-probabilities, a bias, a penalty, a
/// temperature, stops still suppressed), `take_argmax` refuses.
#[test]
fn an_argmax_taken_is_what_greedy_sampling_picks() {
    let mut rows = random_rows(40, 37, 5);
    rows[3] = vec![0.5; 37];
    rows[4][7] = 9.0;
    rows[4][20] = 9.0;
    rows[5] = vec![0.0; 37];
    rows[5][0] = -0.0;
    let greedy = SamplingParams {
        temperature: 0.0,
        seed: Some(3),
        ..SamplingParams::default()
    };
    let (mut by_logits, mut by_argmax) = (sampler(greedy.clone(), 37), sampler(greedy, 37));
    for row in &rows {
        assert!(by_argmax.takes_argmax());
        let want = by_logits.sample(row).unwrap();
        let got = by_argmax.take_argmax(argmax(row).unwrap()).unwrap();
        assert_eq!(got, want);
    }
    assert_eq!(argmax(&rows[3]), Ok(0));
    assert_eq!(argmax(&rows[4]), Ok(7));
    assert_eq!(argmax(&rows[5]), Ok(0));
    assert_eq!(argmax(&[1.0, f32::NAN, f32::INFINITY]), Err(1));
    assert_eq!(argmax(&[]), Err(0));
    let others = [
        SamplingParams {
            logprobs: true,
            ..SamplingParams::default()
        },
        SamplingParams {
            logit_bias: vec![(3, 1.0)],
            temperature: 0.0,
            ..SamplingParams::default()
        },
        SamplingParams {
            frequency_penalty: 0.5,
            temperature: 0.0,
            ..SamplingParams::default()
        },
        SamplingParams {
            repetition_penalty: 1.2,
            temperature: 0.0,
            ..SamplingParams::default()
        },
        random(0.7, 1),
    ];
    for params in others {
        let mut s = sampler(params.clone(), 37);
        assert!(!s.takes_argmax(), "{params:?}");
        assert!(matches!(s.take_argmax(0), Err(SamplingError::NotArgmax)));
    }
    // Stops suppressed until `min_tokens`: logits only until then.
    let mut s = Sampler::new(
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        StopConditions {
            min_tokens: 2,
            eos_token_ids: vec![1],
            ..stop(10)
        },
        &[],
        37,
        0,
    )
    .unwrap();
    assert!(!s.takes_argmax());
    s.sample(&rows[0]).unwrap();
    s.sample(&rows[1]).unwrap();
    assert!(s.takes_argmax());
}
