//! The router's OpenAI API end to end: the real `pdserve-router` binary with the in-process
//! engine over a tiny synthetic checkpoint (real DeepSeek-V4 tokenizer).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::{net::SocketAddr, time::Duration};

use integration_tests::{
    HttpResponse, fold_chat_stream as fold_stream, http, start_router, tiny_model_dir,
};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(120);

fn post(addr: SocketAddr, path: &str, body: &Value) -> HttpResponse {
    http(addr, "POST", path, &[], body.to_string().as_bytes(), T)
}

fn model_arg() -> String {
    tiny_model_dir().display().to_string()
}

fn text(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_owned()
}

#[test]
fn chat_stream_equals_non_stream_and_seeds_are_deterministic() {
    let router = start_router(&["--model-dir", &model_arg()], true);
    let addr = router.addr("http");
    let cases = [
        (1_u64, json!(null), 24),
        (2, json!({"type": "disabled"}), 24),
        (3, json!({"type": "enabled"}), 16),
        (42, json!({"type": "disabled"}), 40),
    ];
    for (seed, thinking, max_tokens) in cases {
        let mut body = json!({
            "model": "deepseek-v4-flash",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": format!("Say something about {seed} ünïcødé 你好")}
            ],
            "max_tokens": max_tokens,
            "temperature": 0.9,
            "seed": seed,
        });
        if !thinking.is_null() {
            body["thinking"] = thinking;
        }
        let a = post(addr, "/v1/chat/completions", &body);
        assert_eq!(a.status, 200, "{}", a.body);
        let a = a.json();
        let b = post(addr, "/v1/chat/completions", &body).json();
        assert_eq!(a["choices"], b["choices"], "same seed, same output");
        assert_eq!(a["object"], "chat.completion");
        assert_eq!(a["model"], "deepseek-v4-flash");
        let message = &a["choices"][0]["message"];
        let usage = &a["usage"];
        assert!(usage["prompt_tokens"].as_u64().unwrap() > 5);
        assert!(usage["completion_tokens"].as_u64().unwrap() <= max_tokens);

        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let s = post(addr, "/v1/chat/completions", &body);
        let (content, reasoning, finish, stream_usage) = fold_stream(&s);
        assert_eq!(content, text(&message["content"]), "seed {seed}");
        assert_eq!(
            reasoning,
            text(&message["reasoning_content"]),
            "seed {seed}"
        );
        assert_eq!(
            finish.as_deref(),
            a["choices"][0]["finish_reason"].as_str(),
            "seed {seed}"
        );
        assert_eq!(stream_usage.as_ref(), Some(usage), "seed {seed}");

        // Without include_usage the same deltas (DeepSeek's official chunk generator still
        // reports usage on the final chunk).
        body["stream_options"] = json!(null);
        let s = post(addr, "/v1/chat/completions", &body);
        let (content2, reasoning2, finish2, _) = fold_stream(&s);
        assert_eq!(
            (content2, reasoning2, finish2),
            (content, reasoning, finish)
        );
    }
}

#[test]
fn chat_thinking_modes_effort_and_aliases() {
    let router = start_router(&["--model-dir", &model_arg(), "--model-alias", "v4"], true);
    let addr = router.addr("http");
    let base = |extra: Value| {
        let mut body = json!({
            "model": "v4",
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 8,
            "seed": 5,
        });
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    // Alias accepted; the response reports the served name.
    let r = post(addr, "/v1/chat/completions", &base(json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["model"], "deepseek-v4-flash");

    // Thinking on by default: reasoning only (the tiny model never closes </think> this soon).
    let on = r.json();
    assert!(!text(&on["choices"][0]["message"]["reasoning_content"]).is_empty());
    // chat_template_kwargs.thinking=false: no reasoning.
    let off = post(
        addr,
        "/v1/chat/completions",
        &base(json!({"chat_template_kwargs": {"thinking": false}})),
    )
    .json();
    assert!(text(&off["choices"][0]["message"]["reasoning_content"]).is_empty());
    assert!(!text(&off["choices"][0]["message"]["content"]).is_empty());

    // The rendered prompts, through /tokenize, end with <think> (128821) or </think> (128822).
    let tok = |extra: Value| {
        let r = post(addr, "/tokenize", &base(extra));
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    // Default effort is high, which the V4 encoding renders as a prefix.
    assert_eq!(tok(json!({})), tok(json!({"reasoning_effort": "high"})));
    assert_eq!(
        tok(json!({"chat_template_kwargs": {"thinking": false}})),
        [0, 128_803, 19_923, 128_804, 128_822]
    );
    assert_eq!(
        tok(json!({"reasoning_effort": "none"})),
        [0, 128_803, 19_923, 128_804, 128_822]
    );
    // low renders no effort prefix; high and max prefix the prompt (different texts).
    assert_eq!(
        tok(json!({"reasoning_effort": "low"})),
        [0, 128_803, 19_923, 128_804, 128_821]
    );
    let high = tok(json!({"reasoning_effort": "high"}));
    let max = tok(json!({"reasoning_effort": "max"}));
    assert!(high.len() > 5 && max.len() > 5 && high != max);
    // medium is not a V4 effort: 400 listing the accepted values.
    let r = post(
        addr,
        "/v1/chat/completions",
        &base(json!({"reasoning_effort": "medium"})),
    );
    assert_eq!(r.status, 400);
    let e = r.json();
    assert_eq!(e["error"]["param"], "reasoning_effort");
    let message = text(&e["error"]["message"]);
    assert!(message.contains("none, low, high, max"), "{message}");
}

#[test]
fn chat_effort_mapping_and_thinking_default_are_configurable() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("router.toml");
    std::fs::write(
        &config,
        "thinking_default = false\nreasoning_effort_map = [\"medium=high\"]\n",
    )
    .unwrap();
    let router = start_router(
        &[
            "--model-dir",
            &model_arg(),
            "--config",
            config.to_str().unwrap(),
        ],
        true,
    );
    let addr = router.addr("http");
    let tok = |extra: Value| {
        let mut body = json!({"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "Hello"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = post(addr, "/tokenize", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["tokens"].clone()
    };
    assert_eq!(
        tok(json!({})),
        json!([0, 128_803, 19_923, 128_804, 128_822])
    );
    assert_eq!(
        tok(json!({"reasoning_effort": "medium"})),
        tok(json!({"reasoning_effort": "high"}))
    );
}

#[test]
fn router_models_tokenize_detokenize_health() {
    let router = start_router(&["--model-dir", &model_arg()], true);
    let addr = router.addr("http");
    let r = http(addr, "GET", "/health", &[], b"", T);
    assert_eq!(r.status, 200);
    let r = http(addr, "GET", "/health/ready", &[], b"", T);
    assert_eq!(r.status, 200);

    let models = http(addr, "GET", "/v1/models", &[], b"", T).json();
    assert_eq!(models["object"], "list");
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids[0], "deepseek-v4-flash");
    assert!(ids.contains(&"DeepSeek-V4-Flash"));
    let max_len = models["data"][0]["max_model_len"].as_u64().unwrap();
    assert!(max_len > 0);

    let t = post(
        addr,
        "/tokenize",
        &json!({"model": "deepseek-v4-flash", "prompt": "Hello world, 你好!"}),
    );
    assert_eq!(t.status, 200, "{}", t.body);
    let t = t.json();
    let tokens = t["tokens"].clone();
    assert_eq!(t["count"], tokens.as_array().unwrap().len());
    assert_eq!(t["max_model_len"].as_u64(), Some(max_len));
    let d = post(
        addr,
        "/detokenize",
        &json!({"model": "deepseek-v4-flash", "tokens": tokens}),
    );
    assert_eq!(d.status, 200, "{}", d.body);
    assert_eq!(d.json()["prompt"], "Hello world, 你好!");
    // The chat form renders with the official encoder.
    let m = post(
        addr,
        "/tokenize",
        &json!({"messages": [{"role": "user", "content": "Hello"}], "reasoning_effort": "low"}),
    );
    assert_eq!(
        m.json()["tokens"],
        json!([0, 128_803, 19_923, 128_804, 128_821])
    );
    // vLLM's `return_token_strs`: each token's vocabulary string.
    let strs = post(
        addr,
        "/tokenize",
        &json!({"messages": [{"role": "user", "content": "Hello"}], "reasoning_effort": "low",
                "return_token_strs": true}),
    );
    assert_eq!(strs.json()["token_strs"][2], "Hello", "{}", strs.body);
    assert_eq!(strs.json()["token_strs"][1], "<｜User｜>", "{}", strs.body);
    // What tokenizing would not read is refused, as on the endpoints it stands for.
    for (body, param) in [
        (
            json!({"messages": [{"role": "user", "content": "Hi"}], "add_special_tokens": true}),
            "add_special_tokens",
        ),
        (
            json!({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": false}),
            "add_generation_prompt",
        ),
        (json!({"prompt": "Hi", "max_tokens": 3}), "max_tokens"),
    ] {
        let r = post(addr, "/tokenize", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{}", r.body);
    }
    let d = post(
        addr,
        "/detokenize",
        &json!({"tokens": [0, 128_803, 19_923, 128_804, 128_821]}),
    );
    assert_eq!(
        d.json()["prompt"],
        "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜><think>"
    );
    let bad = post(addr, "/detokenize", &json!({"tokens": [999_999_999]}));
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"]["param"], "tokens");
}

#[test]
fn chat_stop_strings_cut_output_in_stream_and_non_stream() {
    let router = start_router(&["--model-dir", &model_arg()], true);
    let addr = router.addr("http");
    let mut body = json!({
        "model": "deepseek-v4-flash",
        "messages": [{"role": "user", "content": "Count"}],
        "max_tokens": 40,
        "seed": 9,
        "thinking": {"type": "disabled"},
    });
    let full =
        text(&post(addr, "/v1/chat/completions", &body).json()["choices"][0]["message"]["content"]);
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 12, "{full:?}");
    let stop: String = chars[8..11].iter().collect();
    let prefix = &full[..full.find(&stop).unwrap()];
    body["stop"] = json!([stop]);
    let cut = post(addr, "/v1/chat/completions", &body).json();
    assert_eq!(text(&cut["choices"][0]["message"]["content"]), prefix);
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    body["stream"] = json!(true);
    let (content, _, finish, _) = fold_stream(&post(addr, "/v1/chat/completions", &body));
    assert_eq!(content, prefix);
    assert_eq!(finish.as_deref(), Some("stop"));
}

/// vLLM's stop extras are honoured, not accepted and dropped: `ignore_eos` runs to
/// `max_tokens` through eos tokens, `stop_token_ids` end the request at once, `min_tokens` holds
/// eos back; bad values are refused naming the parameter.
#[test]
fn chat_ignore_eos_stop_token_ids_and_min_tokens_are_honoured() {
    const EOS: u32 = 1;
    let router = start_router(&["--model-dir", &model_arg()], true);
    let addr = router.addr("http");
    // A token that decodes to text on its own (a word, not a piece of a UTF-8 sequence).
    let word = post(
        addr,
        "/tokenize",
        &json!({"prompt": " hello", "add_special_tokens": false}),
    )
    .json();
    let other = word["tokens"][0].as_u64().unwrap();
    let ask = |extra: Value| {
        let mut body = json!({
            "model": "deepseek-v4-flash",
            "messages": [{"role": "user", "content": "Count."}],
            "thinking": {"type": "disabled"},
            "temperature": 0.0,
            "max_tokens": 40,
        });
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        post(addr, "/v1/chat/completions", &body)
    };
    let usage_and_finish = |r: &HttpResponse| {
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        (
            v["usage"]["completion_tokens"].as_u64().unwrap(),
            text(&v["choices"][0]["finish_reason"]),
        )
    };
    let eos_always = json!({ EOS.to_string(): 100 });
    // Every token is eos: without ignore_eos the first one ends the request, and usage
    // counts it (as vLLM and /v1/completions do), though it has no text.
    let r = ask(json!({"logit_bias": eos_always}));
    let (at_once, finish) = usage_and_finish(&r);
    assert_eq!((at_once, finish.as_str()), (1, "stop"));
    assert_eq!(
        r.json()["choices"][0]["message"]["content"],
        "",
        "{}",
        r.body
    );
    let r = ask(json!({"logit_bias": eos_always, "ignore_eos": true}));
    assert_eq!(usage_and_finish(&r), (40, "length".to_owned()));
    // min_tokens masks eos until that many tokens exist.
    let r = ask(json!({"logit_bias": eos_always, "min_tokens": 5}));
    assert_eq!(usage_and_finish(&r), (at_once + 5, "stop".to_owned()));
    // A listed stop id ends the request as eos does.
    let other_always = json!({ other.to_string(): 100 });
    let r = ask(json!({"logit_bias": other_always}));
    assert_eq!(usage_and_finish(&r), (40, "length".to_owned()));
    // A token that is only part of a UTF-8 character (id 300 in V4's vocabulary): its text
    // never completes, and every one of them is still counted.
    let r = ask(json!({"logit_bias": {"300": 100}}));
    assert_eq!(usage_and_finish(&r), (40, "length".to_owned()));
    let r = ask(json!({"logit_bias": other_always, "stop_token_ids": [other]}));
    assert_eq!(usage_and_finish(&r), (1, "stop".to_owned()));

    for (extra, param) in [
        (json!({"ignore_eos": "yes"}), "ignore_eos"),
        (json!({"stop_token_ids": [-1]}), "stop_token_ids"),
        (json!({"stop_token_ids": 7}), "stop_token_ids"),
        (json!({"min_tokens": 41}), "min_tokens"),
        (json!({"min_tokens": -1}), "min_tokens"),
        // Neither OpenAI's nor vLLM's: OpenAI's own answer, never a silent 200.
        (json!({"frobnicate_level": 3}), "frobnicate_level"),
        // Known, but not supported: refused rather than ignored.
        (
            json!({"guided_whitespace_pattern": "[ ]*"}),
            "guided_whitespace_pattern",
        ),
        (json!({"structural_tag": {}}), "structural_tag"),
    ] {
        let r = ask(extra.clone());
        assert_eq!(r.status, 400, "{extra}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{extra}");
    }
}

/// In thinking mode (the default) the request's temperature, top-p and penalties are used as
/// given (DeepSeek's converter would sample at its own temperature 1 and top-p, and zero the
/// penalties, without a word): at temperature 0, or with top-p keeping one token, every seed
/// gives the same answer; a frequency penalty changes the greedy answer. The same through the
/// Messages API, which has no seed.
#[test]
fn sampling_fields_are_honoured_in_thinking_mode() {
    let router = start_router(&["--model-dir", &model_arg()], true);
    let addr = router.addr("http");
    let chat = |extra: Value, seed: u64| {
        let mut body = json!({
            "model": "deepseek-v4-flash",
            "messages": [{"role": "user", "content": "Count to ten, slowly."}],
            "max_tokens": 16,
            "seed": seed,
        });
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = post(addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let message = r.json()["choices"][0]["message"].clone();
        (
            text(&message["reasoning_content"]),
            text(&message["content"]),
        )
    };
    for extra in [
        json!({"temperature": 0.0}),
        json!({"temperature": 1.0, "top_p": 1e-9}),
    ] {
        let answers: Vec<_> = (1..=3).map(|seed| chat(extra.clone(), seed)).collect();
        assert!(!answers[0].0.is_empty(), "thinking mode: {answers:?}");
        assert!(
            answers.iter().all(|a| *a == answers[0]),
            "{extra}: {answers:?}"
        );
    }
    // Unconstrained sampling at temperature 1: the seeds' answers differ (the control).
    let free: Vec<_> = (1..=3).map(|seed| chat(json!({}), seed)).collect();
    assert!(free.iter().any(|a| *a != free[0]), "{free:?}");
    let greedy = chat(json!({"temperature": 0.0}), 1);
    // A negative penalty favours the tokens already written: the greedy answer repeats them.
    let penalised = chat(json!({"temperature": 0.0, "frequency_penalty": -2.0}), 1);
    assert_ne!(greedy, penalised, "the penalty changes the greedy answer");
    let messages = |_: u64| {
        let body = json!({
            "model": "deepseek-v4-flash",
            "messages": [{"role": "user", "content": "Count to ten, slowly."}],
            "max_tokens": 16,
            "temperature": 0.0,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        });
        let r = post(addr, "/v1/messages", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        // The blocks' texts (a thinking block's signature names its request).
        let blocks = r.json()["content"].as_array().unwrap().clone();
        blocks
            .iter()
            .map(|b| format!("{}{}", text(&b["thinking"]), text(&b["text"])))
            .collect::<Vec<_>>()
    };
    let first = messages(0);
    assert!(!first.is_empty() && !first[0].is_empty(), "{first:?}");
    assert!((1..3).all(|i| messages(i) == first), "{first:?}");
}
