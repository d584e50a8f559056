//! Constraints on V4's real token table with random logits: whatever the model would have
//! said, the output follows the grammar and ends when the grammar does.

use std::sync::{Arc, OnceLock};

use proto::request::{FinishReason, Grammar, OutputConstraint, SamplingParams, StopConditions};
use serde_json::{Value, json};

use super::{GrammarError, TokenTable};
use crate::sampling::{Sampler, SamplingError};

const VOCAB: usize = 129_280;
const EOS: u32 = 1;

fn table() -> Arc<TokenTable> {
    static TABLE: OnceLock<Arc<TokenTable>> = OnceLock::new();
    Arc::clone(TABLE.get_or_init(|| {
        let path = common::assets::deepseek_v4_tokenizer().expect("run scripts/setup");
        let text = std::fs::read(path).expect("tokenizer.json");
        Arc::new(TokenTable::from_tokenizer_json(&text, VOCAB, &[EOS, 2]).expect("table"))
    }))
}

/// Deterministic pseudo-random logits in [-8, 8) for step `step` of stream `seed`.
fn logits(seed: u64, step: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ step.wrapping_mul(0xD1B5_4A32_D192_ED03);
    (0..VOCAB)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 16.0 - 8.0
        })
        .collect()
}

fn constraint(grammar: Grammar) -> OutputConstraint {
    OutputConstraint {
        grammar,
        start_after_token: None,
        whitespace_flexible: false,
    }
}

fn stop(max_tokens: u32, ignore_eos: bool) -> StopConditions {
    StopConditions {
        max_tokens,
        min_tokens: 0,
        stop_token_ids: Vec::new(),
        ignore_eos,
        eos_token_ids: vec![EOS],
    }
}

/// Samples at temperature 1 under `c` until the request finishes; the tokens and why.
fn generate(
    c: &OutputConstraint,
    seed: u64,
    stop: StopConditions,
) -> Result<(Vec<u32>, FinishReason), SamplingError> {
    let params = SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        constraint: Some(c.clone()),
        ..SamplingParams::default()
    };
    let compiled = table().compile(c)?;
    let mut sampler = Sampler::new(params, stop, &[0], VOCAB, seed)?.constrained(compiled);
    let mut step = 0;
    loop {
        sampler.sample(&logits(seed, step))?;
        step += 1;
        if let Some(reason) = sampler.finish() {
            return Ok((sampler.generated().to_vec(), reason));
        }
    }
}

/// The generated text without a final eos.
fn text(tokens: &[u32]) -> String {
    let body = tokens.strip_suffix(&[EOS]).unwrap_or(tokens);
    String::from_utf8(table().token_bytes(body)).expect("utf-8")
}

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "level": {"enum": ["low", "medium", "high"]},
            "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                       "maxItems": 3},
            "owner": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                               "active": {"type": "boolean"}},
                "required": ["id", "active"],
                "additionalProperties": false
            }
        },
        "required": ["name", "level", "scores", "owner"],
        "additionalProperties": false
    })
}

/// The schema's own rules, checked by hand on the parsed value.
fn follows_schema(v: &Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    let name_ok = o["name"].as_str().is_some_and(|s| s.chars().count() <= 8);
    let level_ok = ["low", "medium", "high"].contains(&o["level"].as_str().unwrap_or(""));
    let scores_ok = o["scores"].as_array().is_some_and(|a| {
        a.len() <= 3
            && a.iter()
                .all(|s| s.as_i64().is_some_and(|n| (0..=99).contains(&n)))
    });
    let owner_ok = o["owner"].as_object().is_some_and(|w| {
        w.len() == 2
            && w["id"].as_i64().is_some_and(|n| (1..=9999).contains(&n))
            && w["active"].is_boolean()
    });
    o.len() == 4 && name_ok && level_ok && scores_ok && owner_ok
}

#[test]
fn random_logits_under_a_json_schema_give_valid_documents() {
    let c = constraint(Grammar::JsonSchema(schema().to_string()));
    for seed in 0..12 {
        let (tokens, reason) = generate(&c, seed, stop(400, false)).expect("generate");
        assert_eq!(reason, FinishReason::Stop, "seed {seed}: {}", text(&tokens));
        let out = text(&tokens);
        let value: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out}: {e}"));
        assert!(follows_schema(&value), "seed {seed}: {out}");
        // Compact whitespace unless asked: no newline or run of spaces anywhere outside strings.
        assert!(!out.contains('\n') && !out.contains("  "), "{out}");
    }
}

#[test]
fn json_object_regex_and_lark_are_followed() {
    let object = constraint(Grammar::JsonObject);
    let regex = constraint(Grammar::Regex("[a-c]{3}-[0-9]{2}".to_owned()));
    let lark = constraint(Grammar::Lark(
        "start: \"answer: \" (\"yes\" | \"no\")".to_owned(),
    ));
    for seed in 0..4 {
        let (tokens, reason) = generate(&object, seed, stop(300, false)).expect("object");
        if reason == FinishReason::Stop {
            let v: Value = serde_json::from_str(&text(&tokens)).expect("json");
            assert!(v.is_object());
        } else {
            // Free-form objects may run past the budget; what was written is still a prefix.
            assert_eq!(tokens.len(), 300);
            assert!(text(&tokens).starts_with('{'));
        }
        let (tokens, reason) = generate(&regex, seed, stop(50, false)).expect("regex");
        assert_eq!(reason, FinishReason::Stop);
        let out = text(&tokens);
        assert!(
            out.len() == 6
                && out[..3].bytes().all(|b| (b'a'..=b'c').contains(&b))
                && &out[3..4] == "-"
                && out[4..].bytes().all(|b| b.is_ascii_digit()),
            "{out}"
        );
        let (tokens, reason) = generate(&lark, seed, stop(50, false)).expect("lark");
        assert_eq!(reason, FinishReason::Stop);
        let out = text(&tokens);
        assert!(out == "answer: yes" || out == "answer: no", "{out}");
    }
}

#[test]
fn a_complete_grammar_ends_the_request_even_under_ignore_eos() {
    let c = constraint(Grammar::Regex("ok".to_owned()));
    let (tokens, reason) = generate(&c, 3, stop(20, true)).expect("generate");
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(text(&tokens), "ok");
}

#[test]
fn the_constraint_starts_after_its_token() {
    // Token 128822 is `</think>` in V4's vocabulary (not marked special there).
    let think_end = 128_822;
    let c = OutputConstraint {
        start_after_token: Some(think_end),
        ..constraint(Grammar::Regex("[0-9]{2}".to_owned()))
    };
    let mut compiled = table().compile(&c).expect("compile");
    // Before the token: anything goes, nothing is masked.
    let mut row = logits(1, 0);
    let before = row.clone();
    compiled.mask(&mut row).expect("mask");
    assert_eq!(row, before);
    for t in [100, 2000, think_end] {
        compiled.consume(t).expect("free text");
    }
    assert!(!compiled.is_complete());
    // After it: only digits.
    compiled.mask(&mut row).expect("mask");
    let allowed: Vec<usize> = (0..VOCAB).filter(|&i| row[i].is_finite()).collect();
    assert!(!allowed.is_empty());
    for &i in &allowed {
        let bytes = table().token_bytes(&[i as u32]);
        assert!(bytes.iter().all(u8::is_ascii_digit), "token {i}: {bytes:?}");
    }
}

#[test]
fn every_eos_id_follows_the_grammars_end() {
    let a = (0..VOCAB as u32)
        .find(|&t| table().token_bytes(&[t]) == b"a")
        .expect("token a");
    // A grammar with nothing left to add is complete at once, with no eos.
    let mut once = table()
        .compile(&constraint(Grammar::Regex("a".to_owned())))
        .expect("compile");
    once.consume(a).expect("a");
    assert!(once.is_complete());
    // One that may go on or end allows every eos id exactly when it may end.
    let mut more = table()
        .compile(&constraint(Grammar::Regex("a+".to_owned())))
        .expect("compile");
    let mut row = vec![0.0f32; VOCAB];
    more.mask(&mut row).expect("mask");
    assert!(row[EOS as usize].is_infinite() && row[2].is_infinite());
    more.consume(a).expect("a");
    let mut row = vec![0.0f32; VOCAB];
    more.mask(&mut row).expect("mask");
    assert!(row[EOS as usize].is_finite() && row[2].is_finite() && row[a as usize].is_finite());
    assert!(!more.is_complete());
    // The second eos id ends the grammar like the first.
    more.consume(2).expect("eos");
    assert!(more.is_complete());
}

#[test]
fn a_token_the_grammar_does_not_allow_is_an_error() {
    let c = constraint(Grammar::Regex("[0-9]+".to_owned()));
    let letter = (0..VOCAB as u32)
        .find(|&t| table().token_bytes(&[t]) == b"x")
        .expect("token x");
    let mut compiled = table().compile(&c).expect("compile");
    assert_eq!(
        compiled.consume(letter),
        Err(GrammarError::Rejected(letter))
    );
    // The same through a sampler taking over tokens drawn elsewhere.
    let params = SamplingParams {
        constraint: Some(c.clone()),
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new(params, stop(5, false), &[0], VOCAB, 1)
        .expect("sampler")
        .constrained(table().compile(&c).expect("compile"));
    assert_eq!(
        sampler.resume(&[letter]),
        Err(SamplingError::Constraint(GrammarError::Rejected(letter)))
    );
}

#[test]
fn grammars_that_do_not_compile_are_refused_with_the_reason() {
    let cases = [
        (Grammar::JsonSchema("{not json".to_owned()), "not JSON"),
        (Grammar::Regex("(unclosed".to_owned()), ""),
        (
            Grammar::Lark("start: undefined_rule".to_owned()),
            "undefined_rule",
        ),
        (
            Grammar::JsonSchema(json!({"type": "string", "format": "no-such-format"}).to_string()),
            "no-such-format",
        ),
    ];
    for (grammar, needle) in cases {
        let err = table()
            .compile(&constraint(grammar.clone()))
            .expect_err("refused");
        let GrammarError::Compile(message) = &err else {
            panic!("{grammar:?}: {err:?}");
        };
        assert!(message.contains(needle), "{grammar:?}: {message}");
    }
}

#[test]
fn the_table_is_built_in_the_background_once_for_every_clone() {
    let path = common::assets::deepseek_v4_tokenizer().expect("run scripts/setup");
    let dir = tempfile::tempdir().expect("dir");
    std::fs::copy(path, dir.path().join("tokenizer.json")).expect("copy");
    let source = super::TokenTableSource::from_dir(dir.path(), VOCAB, &[EOS]);
    let clone = source.clone();
    let started = std::time::Instant::now();
    source.build_in_background();
    // Nothing asked for it: the thread builds it (bounded wait).
    while !clone.is_built() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "not built"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    eprintln!("token table built in {:?}", started.elapsed());
    let (a, b) = (source.get().expect("table"), clone.get().expect("table"));
    assert!(Arc::ptr_eq(&a, &b), "one build");
    // A source with no folder has nothing to build and refuses.
    let none = super::TokenTableSource::none();
    none.build_in_background();
    assert!(!none.is_built());
    assert!(none.get().is_err());
}
