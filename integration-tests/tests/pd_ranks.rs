//! Workers over several CPU ranks (expert parallelism with data-parallel attention, and
//! tensor-parallel attention): a cluster whose prefill and decode workers have different rank
//! layouts answers what the one-process engine answers, token for token and logprob for
//! logprob, with the state written into the pages of the decode rank the reservation names, or
//! into every rank's copy under TP (over TCP and over UCX, where rank `r`'s pages are their own
//! registered regions); workers with sliced experts (`--moe-tp`) answer greedy requests as one
//! engine does, logprobs within 1e-4; and a rank that hangs mid-decode fails the worker's
//! requests within 2 s and the worker reports itself failed.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::time::{Duration, Instant};

use integration_tests::{
    Service, http,
    pd::{
        T, chat, essence, listed, model_arg, open_stream, post, read_until_error, wait_idle,
        worker_command, worker_command_on,
    },
    start_router,
};
use serde_json::{Value, json};

/// A decode and a prefill worker with their own extra flags, offering `transport` only, and a
/// router over them.
fn layout(prefill: &[&str], decode: &[&str], transport: &str) -> (Service, Service, Service) {
    layout_on(&model_arg(), (prefill, decode), transport)
}

/// [`layout`] serving the checkpoint at `model`.
fn layout_on(
    model: &str,
    (prefill, decode): (&[&str], &[&str]),
    transport: &str,
) -> (Service, Service, Service) {
    let common = ["--page-size", "16", "--transport", transport];
    let mut decode = worker_command_on(
        model,
        "pdserve-decode",
        &[&common[..], &["--max-batch-tokens", "37"], decode].concat(),
    );
    // Its log says on which rank each reservation went.
    decode.env("PDSERVE_LOG", "info");
    let decode = Service::start(decode);
    let prefill = Service::start(worker_command_on(
        model,
        "pdserve-prefill",
        &[&common[..], &["--max-batch-tokens", "37"], prefill].concat(),
    ));
    let router = integration_tests::pd::router_over_on(model, &decode, &prefill, &[]);
    (router, decode, prefill)
}

/// Sends every body to `addr` at once (each from its own thread); the answers in order.
fn concurrently(addr: std::net::SocketAddr, bodies: &[Value]) -> Vec<Value> {
    std::thread::scope(|s| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| s.spawn(move || essence(&post(addr, "/v1/chat/completions", b))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `text` without its terminal colour codes (`ESC [ ... m`).
fn without_colours(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[test]
fn prefill_and_decode_of_different_rank_layouts_answer_what_one_engine_answers() {
    let local = start_router(&["--model-dir", &model_arg()], true);
    let bodies: Vec<Value> = [0usize, 1, 9, 30, 62, 130, 250, 400]
        .into_iter()
        .enumerate()
        .map(|(i, words)| {
            let temperature = if i % 2 == 0 { 0.0 } else { 0.9 };
            chat(words, 300 + i as u64, temperature, 9)
        })
        .collect();
    let want: Vec<Value> = bodies
        .iter()
        .map(|b| essence(&post(local.addr("http"), "/v1/chat/completions", b)))
        .collect();
    let ep = |n: &'static str| vec!["--ep", n, "--dp-attention"];
    let tp = vec!["--tp", "2"];
    // Each rank stepping whole steps on its own (emulated) device, exchanging its routed
    // experts' pairs at every MoE layer: prompt chunks on the prefill side, decode steps on
    // the decode side.
    let on_devices = |n: &'static str| [ep(n), vec!["--backend", "emulated"]].concat();
    // Tensor-parallel ranks on their (emulated) devices, each with half the heads, gathering
    // the attention's output groups at every layer; with the experts split too, each computing
    // its experts' pairs and the ranks summing their rows.
    let tp_on_devices = |experts: bool| {
        let mut flags = vec!["--tp", "2", "--backend", "emulated"];
        if experts {
            flags.extend(["--ep", "2"]);
        }
        flags
    };
    // The decode side's steps replayed as graphs would replay them (plan pass, then launch
    // pass with the group's collectives in it).
    let with_graphs = |flags: Vec<&'static str>| [flags, vec!["--decode-graphs", "true"]].concat();
    // (prefill flags, decode flags, decode ranks holding requests apart, transport)
    for (prefill, decode, spread, transport) in [
        (vec![], ep("2"), 2, "tcp"),
        (on_devices("2"), on_devices("2"), 2, "tcp"),
        (ep("2"), ep("4"), 4, "ucx"),
        (tp.clone(), ep("2"), 2, "tcp"),
        // Every decode rank holds a copy of each request's state: written to each over UCX.
        (ep("2"), tp.clone(), 1, "ucx"),
        (tp.clone(), tp.clone(), 1, "tcp"),
        (tp_on_devices(true), tp_on_devices(false), 1, "tcp"),
        (
            tp_on_devices(false),
            with_graphs(tp_on_devices(true)),
            1,
            "tcp",
        ),
    ] {
        let (router, decode_worker, prefill_worker) = layout(&prefill, &decode, transport);
        let addr = router.addr("http");
        // One at a time, then all at once: requests on several ranks step together.
        for (body, want) in bodies.iter().zip(&want) {
            let got = essence(&post(addr, "/v1/chat/completions", body));
            assert_eq!(&got, want, "{prefill:?} -> {decode:?} over {transport}");
        }
        let got = concurrently(addr, &bodies);
        for (got, want) in got.iter().zip(&want) {
            assert_eq!(
                got, want,
                "{prefill:?} -> {decode:?} over {transport}, together"
            );
        }
        // Every state moved over the transport configured.
        let metrics = http(addr, "GET", "/metrics", &[], b"", T).body;
        let line = format!(
            "pdserve_transfers_total{{transport=\"{transport}\"}} {}",
            2 * bodies.len()
        );
        assert!(metrics.lines().any(|l| l == line), "no {line} in {metrics}");
        // The router sees each decode rank's pool (a replicated group's is one pool), and a
        // request fits one rank's.
        let decode_listing = listed(addr)
            .into_iter()
            .find(|w| w["role"] == "decode")
            .unwrap();
        // A TP worker lists each rank too; every rank holds a copy, so its totals are one
        // rank's pool.
        let replicated = decode.contains(&"--tp");
        let rank_loads = decode_listing["ranks"].as_array().unwrap();
        assert_eq!(
            rank_loads.len(),
            if replicated { 2 } else { spread },
            "{decode_listing}"
        );
        let rank_pages = rank_loads[0]["pages_total"].as_u64().unwrap();
        let copies = if replicated { 1 } else { spread as u64 };
        assert_eq!(
            decode_listing["pages_total"].as_u64(),
            Some(rank_pages * copies)
        );
        let models = http(addr, "GET", "/v1/models", &[], b"", T).json();
        let context = models["data"][0]["max_model_len"].as_u64().unwrap();
        assert!(context <= rank_pages * 16, "{context} > one rank's pool");
        // Requests were placed on more than one rank, and every rank's pages came back.
        let log = without_colours(&decode_worker.stderr());
        for r in 0..spread.min(2) {
            assert!(
                log.contains(&format!("rank={r}")),
                "no request on decode rank {r}: {log}"
            );
        }
        // Its plan says where it stepped.
        let plan = if decode.contains(&"--decode-graphs") {
            "emulated, graphs (the whole decode step on the device, 2 tensor-parallel ranks each \
             with 1/2 of the heads and of the experts)"
        } else if decode.contains(&"--tp") {
            "emulated (the whole decode step on the device, 2 tensor-parallel ranks each with 1/2 \
             of the heads)"
        } else {
            "emulated (the whole decode step on the device, each of 2 expert-parallel ranks on \
             its own)"
        };
        assert_eq!(log.contains(plan), decode.contains(&"emulated"), "{log}");
        wait_idle(decode_worker.addr("grpc"), "decode");
        wait_idle(prefill_worker.addr("grpc"), "prefill");
    }
}

/// Every logprob of a chat answer's tokens and their alternatives, in order.
fn logprobs(answer: &Value) -> Vec<f64> {
    answer["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| {
            std::iter::once(t["logprob"].as_f64().unwrap()).chain(
                t["top_logprobs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|a| a["logprob"].as_f64().unwrap()),
            )
        })
        .collect()
}

/// Workers whose experts are sliced over their tensor-parallel ranks (`--moe-tp`), on the host
/// forward and stepping on their (emulated) devices, answer greedy requests with one engine's text, tokens and
/// alternatives, every logprob within 1e-4 (the sliced sums differ from one engine's in the
/// last bits; `engine/tests/sliced_experts.rs`).
#[test]
fn sliced_experts_answer_greedy_requests_as_one_engine_does() {
    // NVFP4 experts: the tiny model's 32 intermediate values cut in two on their scale blocks.
    let model = integration_tests::tiny_nvfp4_model_dir()
        .display()
        .to_string();
    let local = start_router(&["--model-dir", &model], true);
    let bodies: Vec<Value> = [1usize, 30, 250]
        .into_iter()
        .enumerate()
        .map(|(i, words)| chat(words, 700 + i as u64, 0.0, 7))
        .collect();
    // The prefill worker's ranks on the host forward; the decode worker's each on its
    // (emulated) device, holding half of every expert's intermediate values and summing both
    // halves' partial outputs device to device, its steps replayed as graphs would replay
    // them (plan pass, then launch pass with the group's collectives in it).
    let sliced = ["--tp", "2", "--moe-tp"];
    let graphs = [
        "--backend",
        "emulated",
        "--decode-graphs",
        "true",
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    let on_devices = [&sliced[..], &graphs].concat();
    let (router, decode_worker, prefill_worker) = layout_on(&model, (&sliced, &on_devices), "tcp");
    for body in &bodies {
        let want = essence(&post(local.addr("http"), "/v1/chat/completions", body));
        let got = essence(&post(router.addr("http"), "/v1/chat/completions", body));
        assert_eq!(got["message"], want["message"], "{body}");
        assert_eq!(got["finish"], want["finish"]);
        let (a, b) = (logprobs(&got), logprobs(&want));
        assert_eq!(a.len(), b.len());
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        assert!(worst <= 1e-4, "a logprob {worst} from one engine's: {body}");
        let tokens = |v: &Value| -> Vec<Value> {
            v["logprobs"]["content"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["token"].clone())
                .collect()
        };
        assert_eq!(tokens(&got), tokens(&want));
    }
    let log = without_colours(&decode_worker.stderr());
    let plan = "emulated, graphs (the whole decode step on the device, 2 tensor-parallel ranks \
                each with 1/2 of the heads and of every expert's intermediate values)";
    assert!(log.contains(plan), "{log}");
    // Steps whose launches repeated ran as their launch pass: the plans written first, then
    // every launch and the group's collectives with no host work between them.
    let metrics = integration_tests::http(
        decode_worker.addr("metrics"),
        "GET",
        "/metrics",
        &[],
        b"",
        Duration::from_secs(10),
    );
    let key = "pdserve_engine_device_steps_total{role=\"decode\",how=\"launch_pass\"} ";
    let launched = metrics
        .body
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.parse::<u64>().ok());
    assert!(launched.is_some_and(|n| n > 0), "{}", metrics.body);
    wait_idle(decode_worker.addr("grpc"), "decode");
    wait_idle(prefill_worker.addr("grpc"), "prefill");
}

#[test]
fn a_hung_rank_fails_the_workers_requests_within_two_seconds() {
    hung_rank(&["--ep", "2", "--dp-attention"]);
}

#[test]
fn a_hung_rank_fails_a_tensor_parallel_workers_requests_within_two_seconds() {
    hung_rank(&["--tp", "2"]);
}

/// A decode worker of `group` whose rank holding the first request hangs.
fn hung_rank(group: &[&str]) {
    let mut decode = worker_command(
        "pdserve-decode",
        &[&["--page-size", "16", "--rank-timeout-ms", "800"], group].concat(),
    );
    decode.env(common::env::INJECT_FAULT, "stall-rank");
    let decode = Service::start(decode);
    let prefill = Service::start(worker_command("pdserve-prefill", &["--page-size", "16"]));
    let router = integration_tests::pd::router_over(&decode, &prefill, &[]);
    let addr = router.addr("http");
    let mut body = chat(20, 3, 0.8, 10_000);
    body["stream"] = json!(true);
    body["logprobs"] = json!(false);
    body.as_object_mut().unwrap().remove("top_logprobs");
    // The first request to start decoding hangs its rank.
    let (mut conn, _) = open_stream(addr, &body);
    let hung = Instant::now();
    let text = read_until_error(&mut conn);
    let elapsed = hung.elapsed();
    assert!(text.contains("\"error\""), "no error event: {text}");
    assert!(text.contains("lockstep"), "the error says why: {text}");
    assert!(
        !text.contains("[DONE]"),
        "a failed stream must not end with [DONE]"
    );
    assert!(
        !text.contains("\"finish_reason\":\"stop\""),
        "a failed stream must not look finished: {text}"
    );
    assert!(elapsed < Duration::from_secs(2), "failed after {elapsed:?}");
    // The worker reports itself failed, and the router sends it nothing more.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let state = listed(addr)
            .into_iter()
            .find(|w| w["role"] == "decode")
            .map(|w| w["state"].clone());
        if state == Some(json!("failed")) {
            break;
        }
        assert!(Instant::now() < deadline, "decode worker state {state:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = post(addr, "/v1/chat/completions", &chat(3, 1, 0.0, 3));
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("no live decode worker"), "{}", r.body);
    // The prefill side holds nothing for the failed request.
    wait_idle(prefill.addr("grpc"), "prefill");
}

/// Pools larger than the host's memory are refused at start with the numbers, not allocated
/// lazily and killed later when requests fill them.
#[test]
fn a_worker_whose_pools_do_not_fit_the_host_refuses_to_start() {
    let cmd = worker_command(
        "pdserve-decode",
        &[
            "--page-size",
            "16",
            "--ep",
            "2",
            "--dp-attention",
            "--engine-num-pages",
            "16000000",
        ],
    );
    let (status, _, stderr) = integration_tests::run_to_exit(cmd, Duration::from_secs(60));
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("the state pools need"), "{stderr}");
    assert!(stderr.contains("2 rank(s)"), "{stderr}");
    assert!(stderr.contains("engine_num_pages"), "{stderr}");
}

/// A client that goes away from a request on a tensor-parallel decode worker: the request is
/// cancelled on every rank, and every rank's pages come back.
#[test]
fn a_disconnect_frees_every_tensor_parallel_ranks_pages() {
    let decode = Service::start(worker_command(
        "pdserve-decode",
        &["--page-size", "16", "--tp", "2"],
    ));
    let prefill = Service::start(worker_command("pdserve-prefill", &["--page-size", "16"]));
    let router = integration_tests::pd::router_over(&decode, &prefill, &[]);
    let mut body = chat(60, 3, 0.8, 10_000);
    body["stream"] = json!(true);
    body["logprobs"] = json!(false);
    body.as_object_mut().unwrap().remove("top_logprobs");
    let (conn, _) = open_stream(router.addr("http"), &body);
    let grpc = decode.addr("grpc");
    let held = |l: &proto::v1::Load| (l.pages_used - l.pages_cached, l.running_requests);
    let wait = |what: &str, ok: &dyn Fn(&[proto::v1::Load]) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let ranks = integration_tests::pd::load(grpc).ranks;
            if ranks.len() == 2 && ok(&ranks) {
                return;
            }
            assert!(Instant::now() < deadline, "{what}: {ranks:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    // Both ranks run the request and hold its pages.
    wait("running on both ranks", &|r| {
        r.iter().all(|l| held(l).1 == 1 && held(l).0 > 0)
    });
    drop(conn);
    wait("freed on both ranks", &|r| {
        r.iter().all(|l| held(l) == (0, 0))
    });
}
