//! Anthropic Messages and OpenAI Responses on the real `pdserve-router` binary, plus the
//! settings every conversation API shares (default output cap, `logit_bias`, API keys in both
//! header spellings).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::{net::SocketAddr, time::Duration};

use integration_tests::{HttpResponse, fold_chat_stream, http, start_router, tiny_model_dir};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(120);

fn post(addr: SocketAddr, path: &str, body: &Value) -> HttpResponse {
    http(addr, "POST", path, &[], body.to_string().as_bytes(), T)
}

fn model_arg() -> String {
    tiny_model_dir().display().to_string()
}

/// Text and thinking of a non-stream Messages response.
fn message_blocks(v: &Value) -> (String, String) {
    let (mut text, mut thinking) = (String::new(), String::new());
    for block in v["content"].as_array().unwrap() {
        match block["type"].as_str().unwrap() {
            "text" => text.push_str(block["text"].as_str().unwrap()),
            "thinking" => thinking.push_str(block["thinking"].as_str().unwrap()),
            other => panic!("unexpected block type {other}"),
        }
    }
    (text, thinking)
}

/// Text, thinking, stop reason and output tokens folded from a Messages SSE stream, checking
/// the event order Anthropic clients rely on.
fn fold_messages_stream(r: &HttpResponse) -> (String, String, String, u64) {
    assert_eq!(r.status, 200, "{}", r.body);
    let events = r.sse_events();
    let names: Vec<&str> = events
        .iter()
        .map(|(name, _)| name.as_deref().expect("every Messages event is named"))
        .collect();
    assert_eq!(names.first(), Some(&"message_start"), "{names:?}");
    assert_eq!(names.last(), Some(&"message_stop"), "{names:?}");
    let (mut text, mut thinking, mut stop, mut output) =
        (String::new(), String::new(), String::new(), 0);
    for (name, data) in &events {
        let v: Value = serde_json::from_str(data).unwrap();
        assert_eq!(
            v["type"].as_str(),
            name.as_deref(),
            "event name = data type"
        );
        match name.as_deref() {
            Some("content_block_delta") => match v["delta"]["type"].as_str().unwrap() {
                "text_delta" => text.push_str(v["delta"]["text"].as_str().unwrap()),
                "thinking_delta" => thinking.push_str(v["delta"]["thinking"].as_str().unwrap()),
                _ => {}
            },
            Some("message_delta") => {
                v["delta"]["stop_reason"]
                    .as_str()
                    .unwrap()
                    .clone_into(&mut stop);
                output = v["usage"]["output_tokens"].as_u64().unwrap();
            }
            _ => {}
        }
    }
    (text, thinking, stop, output)
}

#[test]
fn messages_stream_equals_non_stream() {
    let router = start_router(&["--model-dir", &model_arg()], true);
    let addr = router.addr("http");
    for (thinking, max_tokens) in [("disabled", 12), ("enabled", 10)] {
        let mut body = json!({
            "model": "deepseek-v4-flash",
            "max_tokens": max_tokens,
            "temperature": 0,
            "system": "You are terse.",
            "thinking": {"type": thinking},
            "messages": [{"role": "user", "content": "Tell me about ünïcødé 你好"}],
        });
        let r = post(addr, "/v1/messages", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let full = r.json();
        assert_eq!(full["type"], "message");
        assert_eq!(full["role"], "assistant");
        assert_eq!(full["model"], "deepseek-v4-flash");
        assert!(full["id"].as_str().unwrap().starts_with("msg"));
        assert!(full["usage"]["input_tokens"].as_u64().unwrap() > 0);
        let output = full["usage"]["output_tokens"].as_u64().unwrap();
        assert!(output >= 1 && output <= max_tokens, "{output}");
        let (text, thought) = message_blocks(&full);
        if thinking == "disabled" {
            assert!(thought.is_empty(), "no thinking block when disabled");
            // Greedy without thinking: the same tokens in both modes.
            body["stream"] = json!(true);
            let (s_text, s_thought, stop, s_output) =
                fold_messages_stream(&post(addr, "/v1/messages", &body));
            assert_eq!(s_text, text);
            assert_eq!(s_thought, thought);
            assert_eq!(stop, full["stop_reason"].as_str().unwrap());
            assert_eq!(s_output, output);
        } else {
            assert!(
                full["content"][0]["type"] == "thinking",
                "thinking comes first: {full}"
            );
        }
    }
}

#[test]
fn messages_errors_use_anthropic_shape() {
    let router = start_router(&["--model-dir", &model_arg(), "--api-key", "k1"], true);
    let addr = router.addr("http");
    let key = [("x-api-key", "k1")];
    let send = |body: &Value, headers: &[(&str, &str)]| {
        http(
            addr,
            "POST",
            "/v1/messages",
            headers,
            body.to_string().as_bytes(),
            T,
        )
    };
    let ok = json!({"model": "deepseek-v4-flash", "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]});
    // Anthropic clients authenticate with x-api-key; OpenAI clients with a Bearer token.
    assert_eq!(send(&ok, &key).status, 200);
    assert_eq!(send(&ok, &[("authorization", "Bearer k1")]).status, 200);
    let unauthorized = send(&ok, &[("x-api-key", "wrong")]);
    assert_eq!(unauthorized.status, 401);
    assert_eq!(unauthorized.json()["type"], "error");
    assert_eq!(unauthorized.json()["error"]["type"], "authentication_error");
    let cases = [
        (
            json!({"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "hi"}]}),
            "max_tokens",
        ),
        (
            json!({"model": "deepseek-v4-flash", "max_tokens": 2, "messages": []}),
            "messages",
        ),
        (
            json!({"model": "nope", "max_tokens": 2,
                   "messages": [{"role": "user", "content": "hi"}]}),
            "nope",
        ),
        (
            json!({"model": "deepseek-v4-flash", "max_tokens": 2, "temperature": 1.5,
                   "messages": [{"role": "user", "content": "hi"}]}),
            "temperature",
        ),
        (
            json!({"model": "deepseek-v4-flash", "max_tokens": 2,
                   "output_config": {"effort": "medium"},
                   "messages": [{"role": "user", "content": "hi"}]}),
            "accepted values: none, low, high, max",
        ),
        // Fields outside Anthropic's schema, or that this server cannot honour: refused, not
        // accepted and dropped.
        (
            json!({"model": "deepseek-v4-flash", "max_tokens": 2, "frobnicate": 3,
                   "messages": [{"role": "user", "content": "hi"}]}),
            "Unrecognized request argument supplied: frobnicate",
        ),
        (
            json!({"model": "deepseek-v4-flash", "max_tokens": 2, "mcp_servers": [{}],
                   "messages": [{"role": "user", "content": "hi"}]}),
            "mcp_servers",
        ),
        (
            json!({"model": "deepseek-v4-flash", "max_tokens": 2,
                   "output_config": {"format": {"type": "json_schema"}},
                   "messages": [{"role": "user", "content": "hi"}]}),
            "output_config.format",
        ),
    ];
    for (body, needle) in cases {
        let r = send(&body, &key);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let v = r.json();
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    }
}

/// Text and reasoning folded from a Responses SSE stream; checks sequence numbers and the
/// terminal event.
fn fold_responses_stream(r: &HttpResponse) -> (String, String, Value) {
    assert_eq!(r.status, 200, "{}", r.body);
    let events = r.sse_events();
    let (mut text, mut reasoning, mut last) = (String::new(), String::new(), Value::Null);
    for (i, (name, data)) in events.iter().enumerate() {
        let v: Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["type"].as_str(), name.as_deref());
        assert_eq!(v["sequence_number"].as_u64(), Some(i as u64));
        match name.as_deref() {
            Some("response.output_text.delta") => text.push_str(v["delta"].as_str().unwrap()),
            Some("response.reasoning_text.delta") => {
                reasoning.push_str(v["delta"].as_str().unwrap());
            }
            _ => {}
        }
        last = v;
    }
    assert_eq!(events[0].0.as_deref(), Some("response.created"));
    assert!(
        matches!(
            last["type"].as_str(),
            Some("response.completed" | "response.incomplete")
        ),
        "{last}"
    );
    (text, reasoning, last["response"].clone())
}

fn response_texts(v: &Value) -> (String, String) {
    let (mut text, mut reasoning) = (String::new(), String::new());
    for item in v["output"].as_array().unwrap() {
        for part in item["content"].as_array().unwrap_or(&Vec::new()) {
            match part["type"].as_str().unwrap() {
                "output_text" => text.push_str(part["text"].as_str().unwrap()),
                "reasoning_text" => reasoning.push_str(part["text"].as_str().unwrap()),
                _ => {}
            }
        }
    }
    (text, reasoning)
}

#[test]
fn responses_stream_equals_non_stream_and_errors() {
    let router = start_router(
        &["--model-dir", &model_arg(), "--max-model-len", "512"],
        true,
    );
    let addr = router.addr("http");
    for (effort, max) in [("none", 12), ("high", 8)] {
        let mut body = json!({
            "model": "deepseek-v4-flash",
            "max_output_tokens": max,
            "temperature": 0,
            "instructions": "Be brief.",
            "reasoning": {"effort": effort},
            "input": [{"role": "user", "content": "Hello ünïcødé"}],
        });
        let r = post(addr, "/v1/responses", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let full = r.json();
        assert_eq!(full["object"], "response");
        assert!(full["id"].as_str().unwrap().starts_with("resp"));
        let output = full["usage"]["output_tokens"].as_u64().unwrap();
        assert!(output >= 1 && output <= max, "{output}");
        let (text, reasoning) = response_texts(&full);
        if effort == "none" {
            assert!(reasoning.is_empty());
            body["stream"] = json!(true);
            let (s_text, s_reasoning, final_response) =
                fold_responses_stream(&post(addr, "/v1/responses", &body));
            assert_eq!(s_text, text);
            assert_eq!(s_reasoning, reasoning);
            assert_eq!(final_response["usage"]["output_tokens"], output);
            assert_eq!(final_response["status"], full["status"]);
        } else {
            assert_eq!(full["output"][0]["type"], "reasoning", "{full}");
        }
    }
    let errors = [
        (json!({"model": "deepseek-v4-flash", "input": ""}), "input"),
        (json!({"model": "deepseek-v4-flash"}), "input"),
        (
            json!({"model": "deepseek-v4-flash", "input": "hi", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
        (
            json!({"model": "deepseek-v4-flash", "input": "hi", "reasoning": {"effort": "medium"}}),
            "reasoning.effort",
        ),
        (
            json!({"model": "deepseek-v4-flash", "input": "hi", "top_p": 0}),
            "top_p",
        ),
        // Outside the Responses schema, or not honoured here: refused naming the field.
        (
            json!({"model": "deepseek-v4-flash", "input": "hi", "frobnicate": 3}),
            "frobnicate",
        ),
        (
            json!({"model": "deepseek-v4-flash", "input": "hi", "background": true}),
            "background",
        ),
        (
            json!({"model": "deepseek-v4-flash", "input": "hi", "previous_response_id": "r"}),
            "previous_response_id",
        ),
        (
            json!({"model": "deepseek-v4-flash", "input": "hi", "reasoning": {"summary": "auto"}}),
            "reasoning.summary",
        ),
        (
            json!({"model": "deepseek-v4-flash", "input": "hi", "text": {"verbosity": "low"}}),
            "text.verbosity",
        ),
    ];
    for (body, param) in errors {
        let r = post(addr, "/v1/responses", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{}", r.body);
    }
    let long = "word ".repeat(1000);
    let r = post(
        addr,
        "/v1/responses",
        &json!({"model": "deepseek-v4-flash", "input": long, "max_output_tokens": 4}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
}

#[test]
fn default_output_cap_and_logit_bias_apply() {
    let router = start_router(
        &["--model-dir", &model_arg(), "--default-max-tokens", "3"],
        true,
    );
    let addr = router.addr("http");
    // No max_tokens: the deployment's cap (3) applies, not the library's 8192/65536.
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"model": "deepseek-v4-flash",
                "messages": [{"role": "user", "content": "Tell me a story"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // An explicit value is kept.
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"model": "deepseek-v4-flash", "max_tokens": 5, "temperature": 0,
                "chat_template_kwargs": {"thinking": false},
                "messages": [{"role": "user", "content": "Tell me a story"}]}),
    );
    assert_eq!(r.json()["usage"]["completion_tokens"], 5, "{}", r.body);

    // A +100 bias makes one ordinary token win every greedy step.
    let token = 3000_u32;
    let piece = post(addr, "/detokenize", &json!({"tokens": [token]})).json()["prompt"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(!piece.is_empty());
    let bias = json!({ token.to_string(): 100 });
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"model": "deepseek-v4-flash", "max_tokens": 4, "temperature": 0,
                "chat_template_kwargs": {"thinking": false}, "logit_bias": bias,
                "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["choices"][0]["message"]["content"],
        piece.repeat(4),
        "{}",
        r.body
    );
    let r = post(
        addr,
        "/v1/completions",
        &json!({"model": "deepseek-v4-flash", "max_tokens": 3, "temperature": 0,
                "logit_bias": bias, "prompt": "Once upon"}),
    );
    assert_eq!(
        r.json()["choices"][0]["text"],
        piece.repeat(3),
        "{}",
        r.body
    );
    for bad in [json!({"abc": 1}), json!({"5": 101}), json!([1, 2])] {
        let r = post(
            addr,
            "/v1/chat/completions",
            &json!({"model": "deepseek-v4-flash", "max_tokens": 1, "logit_bias": bad,
                    "messages": [{"role": "user", "content": "hi"}]}),
        );
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], "logit_bias");
    }
}

const WEATHER_TOOL: &str = r#"{"type": "function", "function": {"name": "weather",
    "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                   "unit": {"type": "string", "enum": ["C", "F"]}}, "required": ["city"]}}}"#;

/// A tool conversation: a call (arguments in the given spelling), its result, a follow-up.
fn tool_conversation(arguments: &Value) -> Value {
    json!([
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Two cities.",
         "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": arguments}},
            {"id": "call_2", "type": "function",
             "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "Rain, 9 C"},
        {"role": "user", "content": "And tomorrow?"},
    ])
}

#[test]
fn tool_round_trip_renders_object_and_string_arguments_the_same() {
    let router = start_router(&["--model-dir", &model_arg()], true);
    let addr = router.addr("http");
    let tools: Value = serde_json::from_str(&format!("[{WEATHER_TOOL}]")).unwrap();
    let spellings = [
        json!("{\"city\": \"Paris\", \"unit\": \"C\"}"),
        json!("{\"city\":\"Paris\",\"unit\":\"C\"}"),
        json!({"city": "Paris", "unit": "C"}),
    ];
    let mut seen = Vec::new();
    for arguments in &spellings {
        let messages = tool_conversation(arguments);
        let tokens = post(
            addr,
            "/tokenize",
            &json!({"model": "deepseek-v4-flash", "messages": messages, "tools": tools}),
        );
        assert_eq!(tokens.status, 200, "{}", tokens.body);
        let r = post(
            addr,
            "/v1/chat/completions",
            &json!({"model": "deepseek-v4-flash", "messages": messages, "tools": tools,
                    "tool_choice": "auto", "max_tokens": 3, "seed": 7}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(
            v["usage"]["prompt_tokens"],
            tokens.json()["count"],
            "the chat request encodes exactly what /tokenize reports"
        );
        seen.push((tokens.json()["tokens"].clone(), v["choices"][0].clone()));
    }
    for (tokens, choice) in &seen[1..] {
        assert_eq!(
            tokens, &seen[0].0,
            "same prompt for every arguments spelling"
        );
        assert_eq!(choice, &seen[0].1, "same seeded answer");
    }
    // Responses: a function_call input item with object or string arguments.
    let mut counts = Vec::new();
    for arguments in &spellings {
        let r = post(
            addr,
            "/v1/responses",
            &json!({"model": "deepseek-v4-flash", "max_output_tokens": 2,
                    "tools": [{"type": "function", "name": "weather",
                               "parameters": tools[0]["function"]["parameters"]}],
                    "input": [
                        {"role": "user", "content": "Weather in Paris?"},
                        {"type": "function_call", "call_id": "call_1", "name": "weather",
                         "arguments": arguments},
                        {"type": "function_call_output", "call_id": "call_1",
                         "output": "Sunny"}]}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        counts.push(r.json()["usage"]["input_tokens"].clone());
    }
    assert!(counts.iter().all(|c| c == &counts[0]), "{counts:?}");
}

/// A small deterministic generator for request parameters.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    fn pick<T: Copy>(&mut self, options: &[T]) -> T {
        options[(self.next() as usize) % options.len()]
    }
}

#[test]
fn randomised_seeded_requests_stream_equals_non_stream() {
    let router = start_router(&["--model-dir", &model_arg()], true);
    let addr = router.addr("http");
    let mut rng = Lcg(20_261_203);
    for case in 0..8 {
        let mut body = json!({
            "model": "deepseek-v4-flash",
            "seed": rng.next(),
            "max_tokens": rng.pick(&[1, 5, 13, 24]),
            "temperature": rng.pick(&[0.0, 0.3, 0.9, 1.5]),
            "top_p": rng.pick(&[1.0, 0.9, 0.5]),
            "top_k": rng.pick(&[-1, 0, 5, 50]),
            "min_p": rng.pick(&[0.0, 0.05]),
            "presence_penalty": rng.pick(&[0.0, 0.5]),
            "frequency_penalty": rng.pick(&[0.0, -0.5, 1.0]),
            "repetition_penalty": rng.pick(&[1.0, 1.2]),
            "chat_template_kwargs": {"thinking": rng.pick(&[true, false])},
            "messages": [{"role": "user",
                          "content": format!("case {case}: {}", "ünï 你好 ".repeat(case + 1))}],
        });
        let r = post(addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{body}: {}", r.body);
        let full = r.json();
        let message = &full["choices"][0]["message"];
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let (content, reasoning, finish, usage) =
            fold_chat_stream(&post(addr, "/v1/chat/completions", &body));
        assert_eq!(content, message["content"].as_str().unwrap_or(""), "{body}");
        assert_eq!(
            reasoning,
            message["reasoning_content"].as_str().unwrap_or(""),
            "{body}"
        );
        assert_eq!(
            finish.as_deref(),
            full["choices"][0]["finish_reason"].as_str()
        );
        assert_eq!(usage.unwrap(), full["usage"], "{body}");
    }
}
