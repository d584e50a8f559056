//! Property tests of the chat request's parsing.

use proptest::prelude::*;
use serde_json::{Map, Value};

use super::*;

/// Any JSON value, a few levels deep.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        "[a-z0-9 é]{0,8}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map("[a-z0-9]{1,4}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

const KEYS: [&str; 16] = [
    "max_tokens",
    "max_completion_tokens",
    "n",
    "top_logprobs",
    "seed",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "top_k",
    "logit_bias",
    "tool_choice",
    "tools",
    "stream",
];

proptest! {
    #![proptest_config(proptest::test_runner::Config { cases: 256, ..Default::default() })]

    /// Whatever value a client puts in the sampling fields, the checks answer (never
    /// panic), and a refusal is a 400 naming a parameter.
    #[test]
    fn sampling_checks_refuse_with_400_or_accept(
        values in proptest::collection::vec((0..KEYS.len(), json_value()), 1..4),
    ) {
        let mut obj = Map::new();
        for (k, v) in values {
            obj.insert(KEYS[k].to_owned(), v);
        }
        let result = check_tool_choice(&obj).and_then(|()| check_sampling(&mut obj));
        if let Err(e) = result {
            let (status, ..) = e.parts();
            prop_assert_eq!(status, axum::http::StatusCode::BAD_REQUEST, "{}", e);
        }
    }
}
