//! The disaggregated cluster against the one-process engine: the real router, prefill and
//! decode binaries on loopback (state moving over the TCP transport) must answer exactly what
//! the router's in-process engine answers, token for token and logprob for logprob, for
//! prompts of many lengths (not multiples of the compression ratios 4 and 128, longer than the
//! sliding window, long enough for the indexer's top-k) and under concurrency.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::time::Duration;

use integration_tests::{
    command, http,
    pd::{
        T, busy, chat, cluster, cluster_full, cluster_with, essence, listed, load, long_request,
        model_arg, open_stream, post, read_until_error, wait_idle, wait_load, wait_ready, worker,
    },
    start_router,
};
use serde_json::{Value, json};

#[test]
fn cluster_equals_single_process_engine_for_many_prompt_lengths_over_tcp() {
    equals_single_process_engine("tcp");
}

#[test]
fn cluster_equals_single_process_engine_for_many_prompt_lengths_over_ucx() {
    equals_single_process_engine("ucx");
}

/// Workers offering only `transport`: if it failed, no request could be served. Steps of 37
/// tokens split long prompts into chunks that end inside pages, so a page's rows arrive in two
/// parts, streamed while later chunks are computed.
fn equals_single_process_engine(transport: &str) {
    let local = start_router(&["--model-dir", &model_arg()], true);
    let cluster = cluster_full(
        1,
        1,
        &[],
        &["--transport", transport, "--max-batch-tokens", "37"],
    );
    let (a, b) = (local.addr("http"), cluster.router.addr("http"));
    let mut lengths = Vec::new();
    for (i, words) in [0usize, 1, 3, 9, 30, 61, 62, 130, 250, 400]
        .into_iter()
        .enumerate()
    {
        let temperature = if i % 2 == 0 { 0.0 } else { 0.9 };
        let body = chat(words, 100 + i as u64, temperature, 12);
        let want = essence(&post(a, "/v1/chat/completions", &body));
        let got = essence(&post(b, "/v1/chat/completions", &body));
        assert_eq!(got, want, "{words} words");
        lengths.push(want["usage"]["prompt_tokens"].as_u64().unwrap());
    }
    // The prompts really cover the awkward cases.
    assert!(
        lengths.iter().any(|&n| n % 4 != 0 && n > 128),
        "{lengths:?}"
    );
    assert!(lengths.iter().any(|&n| n > 256), "{lengths:?}");
    assert!(lengths.iter().any(|&n| n < 16), "{lengths:?}");

    // Every state moved over the configured transport, and the router counted it.
    let metrics = http(b, "GET", "/metrics", &[], b"", T).body;
    let count = |t: &str| -> u64 {
        let prefix = format!("pdserve_transfers_total{{transport=\"{t}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} in {metrics}"))
    };
    let other = if transport == "ucx" { "tcp" } else { "ucx" };
    assert_eq!(count(transport), 10, "{metrics}");
    assert_eq!(count(other), 0);
    assert!(metrics.contains(&format!(
        "pdserve_transfer_bytes_total{{transport=\"{transport}\"}}"
    )));

    // Streaming through the cluster gives the same text.
    let mut body = chat(45, 7, 0.7, 10);
    let want = post(a, "/v1/chat/completions", &body).json();
    body["stream"] = json!(true);
    let (content, _, finish, _) =
        integration_tests::fold_chat_stream(&post(b, "/v1/chat/completions", &body));
    assert_eq!(content, want["choices"][0]["message"]["content"]);
    assert_eq!(
        finish.as_deref(),
        want["choices"][0]["finish_reason"].as_str()
    );

    // The prompt's log-probabilities (`echo` with `logprobs`) are computed by the prefill
    // worker, in chunks of 37 tokens: the same values as the in-process engine's, listed
    // before the completion's, streamed or not.
    let text: Vec<String> = (0..70).map(|i| format!("v{}", (i * 31) % 997)).collect();
    let mut body = json!({
        "model": "deepseek-v4-flash",
        "prompt": text.join(" "),
        "max_tokens": 5,
        "logprobs": 2,
        "echo": true,
        "seed": 3,
        "temperature": 0.8,
    });
    let want = post(a, "/v1/completions", &body).json();
    let got = post(b, "/v1/completions", &body).json();
    assert_eq!(got["choices"], want["choices"]);
    assert_eq!(got["usage"], want["usage"]);
    let lp = &want["choices"][0]["logprobs"];
    let prompt_tokens = want["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert!(prompt_tokens > 74, "{prompt_tokens}");
    let listed = lp["tokens"].as_array().unwrap().len();
    assert!(listed >= prompt_tokens + 4, "{listed} listed");
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
    for k in 1..prompt_tokens {
        assert!(lp["token_logprobs"][k].as_f64().unwrap() <= 0.0, "{lp}");
        assert_eq!(lp["top_logprobs"][k].as_object().unwrap().len(), 2, "{lp}");
    }
    body["stream"] = json!(true);
    let streamed = post(b, "/v1/completions", &body);
    let mut tokens = Vec::new();
    let mut logprobs = Vec::new();
    for d in streamed.sse_data().iter().filter(|d| *d != "[DONE]") {
        let c: Value = serde_json::from_str(d).unwrap();
        if let Some(l) = c["choices"][0]["logprobs"].as_object() {
            tokens.extend(l["tokens"].as_array().unwrap().clone());
            logprobs.extend(l["token_logprobs"].as_array().unwrap().clone());
        }
    }
    assert_eq!(Value::from(tokens), lp["tokens"]);
    assert_eq!(Value::from(logprobs), lp["token_logprobs"]);
}

#[test]
fn concurrent_mixed_requests_each_equal_their_solo_answer() {
    let local = start_router(&["--model-dir", &model_arg()], true);
    let cluster = cluster(2, 2);
    let (a, b) = (local.addr("http"), cluster.router.addr("http"));
    let bodies: Vec<Value> = (0..32u64)
        .map(|i| {
            let words = [2usize, 40, 90, 7, 140, 23][(i % 6) as usize] + i as usize;
            let temperature = if i % 3 == 0 { 0.0 } else { 0.8 };
            chat(words, 1000 + i, temperature, 4 + (i % 5) as u32)
        })
        .collect();
    let solo: Vec<Value> = bodies
        .iter()
        .map(|body| essence(&post(a, "/v1/chat/completions", body)))
        .collect();
    let answers: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|body| s.spawn(move || essence(&post(b, "/v1/chat/completions", body))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (got, want)) in answers.iter().zip(&solo).enumerate() {
        assert_eq!(got, want, "request {i}");
    }
}

#[test]
fn client_disconnect_cancels_both_legs_and_frees_pages() {
    let cluster = cluster(1, 1);
    let router = cluster.router.addr("http");
    let (decode, prefill) = (
        cluster.workers[0].addr("grpc"),
        cluster.workers[1].addr("grpc"),
    );
    // Warm: one full request, so baselines include nothing transient.
    assert_eq!(
        post(router, "/v1/chat/completions", &chat(10, 1, 0.0, 3)).status,
        200
    );
    wait_idle(decode, "decode");
    wait_idle(prefill, "prefill");
    for _ in 0..3 {
        let (conn, _) = open_stream(router, &long_request());
        wait_load(
            decode,
            "the long request runs on the decode worker",
            |(pages, n, _)| n == 1 && pages > 0,
        );
        drop(conn);
        wait_idle(decode, "decode");
        wait_idle(prefill, "prefill");
    }
}

#[test]
fn killed_decode_worker_fails_its_requests_and_new_ones_avoid_it() {
    let mut cluster = cluster(1, 2);
    let router = cluster.router.addr("http");
    let (conn, _) = open_stream(router, &long_request());
    let decodes = [
        cluster.workers[0].addr("grpc"),
        cluster.workers[1].addr("grpc"),
    ];
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let victim = loop {
        if let Some(i) = (0..2).find(|&i| busy(decodes[i]).1 == 1) {
            break i;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the request runs nowhere"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let killed = std::time::Instant::now();
    cluster.workers[victim].signal(nix::sys::signal::Signal::SIGKILL);
    let _ = cluster.workers[victim].wait(Duration::from_secs(5));
    // The in-flight request ends with an error event, never [DONE], within 2 s.
    let mut conn = conn;
    let text = read_until_error(&mut conn);
    let elapsed = killed.elapsed();
    assert!(text.contains("\"error\""), "no error event: {text}");
    assert!(
        !text.contains("[DONE]"),
        "a failed stream must not end with [DONE]"
    );
    assert!(elapsed < Duration::from_secs(2), "failed after {elapsed:?}");
    // New requests go to the surviving worker (after at most one poll interval).
    std::thread::sleep(Duration::from_millis(1500));
    for i in 0..4 {
        let r = post(
            router,
            "/v1/chat/completions",
            &chat(5 + i, i as u64, 0.0, 3),
        );
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let survivor = decodes[1 - victim];
    wait_idle(survivor, "surviving decode");
    wait_idle(cluster.workers[2].addr("grpc"), "prefill");
}

#[test]
fn a_failed_prefill_is_retried_once_on_another_worker() {
    let mut cluster = cluster(2, 1);
    let router = cluster.router.addr("http");
    let reference = post(router, "/v1/chat/completions", &chat(12, 5, 0.0, 4));
    assert_eq!(reference.status, 200);
    // Kill one prefill worker and send requests at once: until the router's next poll (every
    // 250 ms) notices, requests spread over both workers, those that pick the dead one fail on
    // the prefill leg and are retried on the other. Every answer must still be right.
    cluster.workers[1].signal(nix::sys::signal::Signal::SIGKILL);
    let body = chat(12, 5, 0.0, 4);
    let answers: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| s.spawn(|| essence(&post(router, "/v1/chat/completions", &body))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for answer in &answers {
        assert_eq!(answer, &essence(&reference));
    }
    let _ = cluster.workers[1].wait(Duration::from_secs(5));
    wait_idle(cluster.workers[0].addr("grpc"), "decode");
    wait_idle(cluster.workers[2].addr("grpc"), "surviving prefill");
}

#[test]
fn prefix_affinity_sends_a_repeated_prompt_to_the_worker_that_cached_it() {
    // Prefill workers with a prefix cache: the same long prompt five times. With prefix
    // affinity one worker holds its blocks; in turn (round-robin) both compute and cache it.
    for (policy, caching_workers) in [("prefix-affinity", 1), ("round-robin", 2)] {
        let cluster = cluster_with(2, 1, &["--prefill-policy", policy]);
        let router = cluster.router.addr("http");
        let body = chat(90, 9, 0.0, 2);
        let first = essence(&post(router, "/v1/chat/completions", &body));
        // The router learns the page size from the workers' Info polls.
        std::thread::sleep(Duration::from_millis(400));
        for _ in 0..5 {
            assert_eq!(essence(&post(router, "/v1/chat/completions", &body)), first);
        }
        let cached: Vec<u64> = [1, 2]
            .iter()
            .map(|&i| load(cluster.workers[i].addr("grpc")).pages_cached)
            .collect();
        assert_eq!(
            cached.iter().filter(|&&c| c > 0).count(),
            caching_workers,
            "{policy}: cached pages per prefill worker {cached:?}"
        );
    }
}

#[test]
fn workers_register_heartbeat_and_are_dropped_when_they_stop() {
    let router = start_router(&["--model-dir", &model_arg(), "--backend", "pd"], false);
    let (http_addr, grpc) = (router.addr("http"), router.addr("grpc").to_string());
    wait_ready(http_addr, 503);
    let mut decode = worker("pdserve-decode", &["--page-size", "16", "--router", &grpc]);
    let _prefill = worker("pdserve-prefill", &["--page-size", "16", "--router", &grpc]);
    wait_ready(http_addr, 200);
    let local = start_router(&["--model-dir", &model_arg()], true);
    let body = chat(33, 4, 0.6, 6);
    assert_eq!(
        essence(&post(http_addr, "/v1/chat/completions", &body)),
        essence(&post(local.addr("http"), "/v1/chat/completions", &body))
    );
    let workers = listed(http_addr);
    assert_eq!(workers.len(), 2, "{workers:?}");
    assert!(
        workers
            .iter()
            .all(|w| w["registered"] == true && w["alive"] == true)
    );
    // `pdctl workers` shows them.
    let mut cmd = command("pdctl");
    cmd.args(["workers", "--url", &http_addr.to_string()]);
    let (status, out, err) = integration_tests::run_to_exit(cmd, T);
    assert!(status.success(), "{err}");
    assert!(
        out.contains("decode") && out.contains("prefill") && out.contains("registered"),
        "{out}"
    );

    // A decode worker that dies stops heartbeating and is dropped; requests are then refused
    // with a clear 503 until another one registers.
    decode.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = decode.wait(Duration::from_secs(5));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while listed(http_addr).iter().any(|w| w["role"] == "decode") {
        assert!(
            std::time::Instant::now() < deadline,
            "the dead worker is still listed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = post(http_addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 503, "{}", r.body);
    let _decode = worker("pdserve-decode", &["--page-size", "16", "--router", &grpc]);
    wait_ready(http_addr, 200);
    let r = post(http_addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
}

/// The context a disaggregated router advertises is what its decode workers' pools hold (not
/// the model's 1M positions), and a request beyond it is a 400 naming `max_tokens`.
#[test]
fn the_advertised_context_is_what_the_decode_pools_hold() {
    // Page size 16 (cluster_full): 300 pages hold 4800 tokens.
    let cluster = cluster_full(1, 1, &[], &["--engine-num-pages", "300"]);
    let router = cluster.router.addr("http");
    let context = || {
        http(router, "GET", "/v1/models", &[], b"", T).json()["data"][0]["max_model_len"]
            .as_u64()
            .unwrap()
    };
    // The router learns the pools from its workers' Info polls (bounded wait).
    let started = std::time::Instant::now();
    while context() != 4800 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "max_model_len {}",
            context()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let ask = |max_tokens: u32| {
        post(
            router,
            "/v1/completions",
            &json!({"model": "deepseek-v4-flash", "prompt": "Hi", "max_tokens": max_tokens}),
        )
    };
    let r = ask(4800);
    assert_eq!(r.status, 400, "{}", r.body);
    let e = r.json();
    assert_eq!(e["error"]["param"], "max_tokens", "{e}");
    assert_eq!(e["error"]["code"], "context_length_exceeded", "{e}");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("4800"),
        "{e}"
    );
    assert_eq!(ask(8).status, 200);
}

/// A decode worker on the emulated device (`--backend emulated`: the GPU decode step, state in
/// slots of device arenas, each kernel by its CPU reference) answers what the in-process engine
/// answers, token for token and logprob for logprob, with the prompts' states arriving over
/// the transport into its reserved pages and loaded into its slots, its steps replayed as graphs
/// would replay them (`--decode-graphs`: plan pass, then launch pass); the prefill worker on
/// the emulated device too (its prompts in chunks of a page through the device step, the
/// state it sends stored from what each chunk added); their start-up logs name the device
/// plans. The emulated backend with hybrid is refused.
#[test]
fn workers_on_the_emulated_device_answer_as_the_engine() {
    let local = start_router(&["--model-dir", &model_arg()], true);
    let mut command = integration_tests::pd::worker_command(
        "pdserve-decode",
        &[
            "--page-size",
            "16",
            "--backend",
            "emulated",
            "--max-running",
            "4",
            "--decode-graphs",
            "true",
        ],
    );
    // Its start-up plan is logged at info.
    command.env("PDSERVE_LOG", "info");
    let mut decode = integration_tests::Service::start(command);
    let mut command = integration_tests::pd::worker_command(
        "pdserve-prefill",
        &["--page-size", "16", "--backend", "emulated"],
    );
    command.env("PDSERVE_LOG", "info");
    let mut prefill = integration_tests::Service::start(command);
    let router = integration_tests::pd::router_over(&decode, &prefill, &[]);
    let (a, b) = (local.addr("http"), router.addr("http"));
    for (i, words) in [0usize, 9, 61, 130].into_iter().enumerate() {
        let temperature = if i % 2 == 0 { 0.0 } else { 0.9 };
        let mut body = chat(words, 300 + i as u64, temperature, 8);
        body["logprobs"] = json!(true);
        body["top_logprobs"] = json!(2);
        let want = essence(&post(a, "/v1/chat/completions", &body));
        let got = essence(&post(b, "/v1/chat/completions", &body));
        assert_eq!(got, want, "{words} words");
    }
    // The prompt's own log-probabilities (`echo` with `logprobs`): every row of each chunk
    // from the device's prompt step.
    let text: Vec<String> = (0..40).map(|i| format!("p{}", (i * 31) % 97)).collect();
    let body = json!({
        "model": "deepseek-v4-flash",
        "prompt": text.join(" "),
        "max_tokens": 4,
        "temperature": 0.0,
        "echo": true,
        "logprobs": 2,
    });
    let (want, got) = (
        post(a, "/v1/completions", &body),
        post(b, "/v1/completions", &body),
    );
    assert_eq!(got.status, 200, "{}", got.body);
    let (want, got) = (want.json(), got.json());
    assert_eq!(got["choices"][0], want["choices"][0]);
    assert!(
        want["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .is_some_and(|t| t.len() > 40),
        "{want}"
    );
    decode.terminate();
    let log = decode.stderr();
    assert!(
        log.contains("emulated, graphs (the whole decode step on the device)"),
        "{log}"
    );
    prefill.terminate();
    let log = prefill.stderr();
    assert!(
        log.contains("emulated, prompt chunks of 256 (whole steps on the device)"),
        "{log}"
    );

    let (status, _, stderr) = integration_tests::run_to_exit(
        integration_tests::pd::worker_command(
            "pdserve-prefill",
            &["--backend", "emulated", "--hybrid", "true"],
        ),
        Duration::from_secs(60),
    );
    assert!(!status.success());
    assert!(stderr.contains("emulated"), "{stderr}");
}

/// A decode worker with the fast attention (`--decode-attention fast`: every head of a request
/// against each tile of its FP8 rows, within the kernel's bound) and the fast routed experts
/// (`--decode-experts fast`: the grouped FP4 GEMV) and the fast linears (`--decode-linears
/// fast`: the dense GEMM on bf16 tensor cores), behind a prefill worker whose prompt chunks
/// run the same fast attention and the dense and grouped GEMMs (`--prefill-attention fast
/// --prefill-linears fast --prefill-experts fast`), gives the greedy answers of exact kernels,
/// on the emulated device with FP8 rows; their plans say so.
#[test]
fn fast_decode_attention_keeps_the_exact_attentions_greedy_answers() {
    let fp8 = ["--page-size", "16", "--kv-cache-dtype", "fp8"];
    let mut answers = Vec::new();
    for attention in ["exact", "fast"] {
        // The fast variant runs the fast routed experts and linears too.
        let experts = if attention == "fast" { "fast" } else { "exact" };
        let mut command = integration_tests::pd::worker_command(
            "pdserve-decode",
            &[
                &fp8[..],
                &["--backend", "emulated", "--decode-attention", attention],
                &["--decode-experts", experts, "--decode-linears", experts],
            ]
            .concat(),
        );
        command.env("PDSERVE_LOG", "info");
        let mut decode = integration_tests::Service::start(command);
        // And the prompts through the device step's GEMMs on the emulated device.
        let mut prefill = if attention == "fast" {
            let mut command = integration_tests::pd::worker_command(
                "pdserve-prefill",
                &[
                    &fp8[..],
                    &["--backend", "emulated", "--prefill-attention", "fast"],
                    &["--prefill-linears", "fast", "--prefill-experts", "fast"],
                ]
                .concat(),
            );
            command.env("PDSERVE_LOG", "info");
            integration_tests::Service::start(command)
        } else {
            worker("pdserve-prefill", &fp8)
        };
        let router = integration_tests::pd::router_over(&decode, &prefill, &[]);
        let mut mine = Vec::new();
        for (i, words) in [3usize, 40, 130].into_iter().enumerate() {
            let body = chat(words, 500 + i as u64, 0.0, 8);
            let answer = post(router.addr("http"), "/v1/chat/completions", &body).json();
            mine.push(answer["choices"][0]["message"]["content"].clone());
        }
        if attention == "fast" {
            prefill.terminate();
            let log = prefill.stderr();
            assert!(
                log.contains(
                    "emulated, prompt chunks of 256, fast attention, fast linears, GEMM experts \
                     (whole steps on the device)"
                ),
                "{log}"
            );
        }
        decode.terminate();
        let log = decode.stderr();
        assert_eq!(
            log.contains(
                "emulated, fast attention, fast experts, fast linears (the whole decode step on \
                 the device)"
            ),
            attention == "fast",
            "{log}"
        );
        answers.push(mine);
    }
    assert_eq!(answers[1], answers[0]);
    assert!(
        answers[0]
            .iter()
            .all(|a| a.as_str().is_some_and(|s| !s.is_empty()))
    );
}

/// bf16 K=V rows (`--kv-cache-dtype bf16`, or vLLM's `bfloat16`): workers on the CPU and
/// workers on the emulated device (prompt chunks and decode steps on the device, rows rounded,
/// stored and read by the FP8 row kernels without e4m3 values) answer alike, token for token
/// and logprob for logprob, over the transport between them; and the rounding shows: the
/// answers' logprobs are not the f32 workers'.
#[test]
fn bf16_rows_answer_alike_on_the_cpu_and_on_the_emulated_device() {
    let bf16 = ["--page-size", "16", "--kv-cache-dtype", "bf16"];
    let on_cpu = (
        worker("pdserve-decode", &bf16),
        worker("pdserve-prefill", &bf16),
    );
    let cpu = integration_tests::pd::router_over(&on_cpu.0, &on_cpu.1, &[]);
    let device = ["--backend", "emulated", "--kv-cache-dtype", "bfloat16"];
    let on_device = (
        worker("pdserve-decode", &[&bf16[..2], &device[..]].concat()),
        worker("pdserve-prefill", &[&bf16[..2], &device[..]].concat()),
    );
    let emulated = integration_tests::pd::router_over(&on_device.0, &on_device.1, &[]);
    let f32 = (
        worker("pdserve-decode", &bf16[..2]),
        worker("pdserve-prefill", &bf16[..2]),
    );
    let exact = integration_tests::pd::router_over(&f32.0, &f32.1, &[]);
    let mut differs = false;
    for (i, words) in [5usize, 70].into_iter().enumerate() {
        let temperature = if i % 2 == 0 { 0.0 } else { 0.9 };
        let mut body = chat(words, 700 + i as u64, temperature, 8);
        body["logprobs"] = json!(true);
        body["top_logprobs"] = json!(2);
        let want = essence(&post(cpu.addr("http"), "/v1/chat/completions", &body));
        let got = essence(&post(emulated.addr("http"), "/v1/chat/completions", &body));
        assert_eq!(got, want, "{words} words");
        let plain = essence(&post(exact.addr("http"), "/v1/chat/completions", &body));
        differs |= plain != want;
    }
    assert!(
        differs,
        "bf16 rows round: some logprob differs from f32 rows'"
    );
}
