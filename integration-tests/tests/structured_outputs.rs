//! Structured outputs through a disaggregated cluster (router, prefill worker, decode worker;
//! the tiny random model): whatever the model would say, the answer follows the request's
//! grammar from its first token (masked on the prefill worker) to its last (masked on the decode
//! worker), and a grammar that cannot be compiled is a 400 with the reason.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use integration_tests::{
    HttpResponse,
    pd::{cluster, post},
};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";

fn ask(addr: std::net::SocketAddr, path: &str, extra: &Value, seed: u64) -> HttpResponse {
    let mut body = if path == CHAT {
        json!({
            "model": "deepseek-v4-flash",
            "messages": [{"role": "user", "content": format!("Describe item {seed} as JSON.")}],
            "thinking": {"type": "disabled"},
        })
    } else {
        json!({"model": "deepseek-v4-flash", "prompt": format!("Item {seed}:")})
    };
    body["temperature"] = json!(1.0);
    body["seed"] = json!(seed);
    body["max_tokens"] = json!(300);
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    post(addr, path, &body)
}

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "level": {"type": "string", "enum": ["low", "medium", "high"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                     "minItems": 1, "maxItems": 3},
            "owner": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}},
                "required": ["id"],
                "additionalProperties": false
            }
        },
        "required": ["name", "level", "tags", "owner"],
        "additionalProperties": false
    })
}

/// The schema's rules, checked by hand.
fn valid(v: &Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    o.len() == 4
        && o["name"].as_str().is_some_and(|s| s.chars().count() <= 12)
        && ["low", "medium", "high"].contains(&o["level"].as_str().unwrap_or(""))
        && o["tags"].as_array().is_some_and(|t| {
            (1..=3).contains(&t.len())
                && t.iter()
                    .all(|s| s.as_str().is_some_and(|s| s.chars().count() <= 6))
        })
        && o["owner"].as_object().is_some_and(|w| {
            w.len() == 1 && w["id"].as_i64().is_some_and(|n| (1..=999).contains(&n))
        })
}

#[test]
fn constrained_answers_follow_their_grammar_across_prefill_and_decode() {
    let c = cluster(1, 1);
    let addr = c.router.addr("http");

    // response_format json_schema on chat: every answer parses and validates.
    let format = json!({"response_format": {"type": "json_schema",
        "json_schema": {"name": "item", "schema": schema(), "strict": true}}});
    for seed in 0..12 {
        let r = ask(addr, CHAT, &format, seed);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let content = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(
            v["choices"][0]["finish_reason"], "stop",
            "seed {seed}: {content}"
        );
        let doc: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{content}: {e}"));
        assert!(valid(&doc), "seed {seed}: {content}");
    }

    // vLLM's extras on /v1/completions: a regex and a choice.
    for seed in 0..4 {
        let r = ask(
            addr,
            "/v1/completions",
            &json!({"guided_regex": "[a-z]{3}-[0-9]{3}"}),
            seed,
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let text = r.json()["choices"][0]["text"].as_str().unwrap().to_owned();
        let b = text.as_bytes();
        assert!(
            b.len() == 7
                && b[..3].iter().all(u8::is_ascii_lowercase)
                && b[3] == b'-'
                && b[4..].iter().all(u8::is_ascii_digit),
            "{text:?}"
        );
        let r = ask(
            addr,
            CHAT,
            &json!({"guided_choice": ["red", "green", "blue"]}),
            seed,
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let content = r.json()["choices"][0]["message"]["content"].clone();
        assert!(
            ["red", "green", "blue"].contains(&content.as_str().unwrap()),
            "{content}"
        );
    }

    // A named function: a call of that function with arguments valid under its schema.
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
    ]);
    let mut calls_seen = 0;
    for seed in 0..4 {
        let named = json!({"tools": tools, "max_tokens": 200,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
        let r = ask(addr, CHAT, &named, seed);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let calls = v["choices"][0]["message"]["tool_calls"].as_array();
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
        let calls = calls.unwrap_or_else(|| panic!("no tool call: {v}"));
        assert!(!calls.is_empty(), "{v}");
        for call in calls {
            assert_eq!(call["function"]["name"], "get_weather", "{v}");
            let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap())
                .unwrap_or_else(|e| panic!("{e}: {v}"));
            assert!(
                ["Paris", "Oslo"].contains(&args["city"].as_str().unwrap()),
                "{args}"
            );
            calls_seen += 1;
            assert!((1..=7).contains(&args["days"].as_i64().unwrap()), "{args}");
        }
    }

    assert!(calls_seen >= 4, "{calls_seen}");

    // What llguidance cannot compile is refused with its reason, before any token.
    let bad = json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
        "schema": {"type": "string", "format": "no-such-format"}}}});
    let r = ask(addr, CHAT, &bad, 1);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("no-such-format"), "{}", r.body);
    let r = ask(
        addr,
        CHAT,
        &json!({"guided_grammar": "start: undefined_rule"}),
        1,
    );
    assert_eq!(r.status, 400, "{}", r.body);
    // Two constraints at once are refused naming the second.
    let both = json!({"response_format": {"type": "json_object"}, "guided_regex": "a"});
    let r = ask(addr, CHAT, &both, 1);
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "guided_regex", "{}", r.body);
}
