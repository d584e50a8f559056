//! `pdctl verify` against real clusters: a healthy one passes every check, and clusters broken
//! on purpose (`PDSERVE_INJECT_FAULT`: a flipped byte in a transferred page, the compressor
//! state dropped, two pages swapped, tokens mixed up between concurrent requests) fail it, each
//! on the check that must catch it.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::time::Duration;

use integration_tests::{
    Service, command,
    pd::{model_arg, router_over, worker_command},
    run_to_exit,
};
use serde_json::Value;

/// One decode and one prefill worker (both with `fault`, each applies the faults of its role)
/// behind a router with `transfer_checksums` on or off.
fn cluster(fault: Option<&str>, checksums: bool) -> (Service, Vec<Service>) {
    let start = |binary: &str| {
        let mut cmd = worker_command(binary, &["--page-size", "16"]);
        if let Some(f) = fault {
            cmd.env("PDSERVE_INJECT_FAULT", f);
        }
        Service::start(cmd)
    };
    let (decode, prefill) = (start("pdserve-decode"), start("pdserve-prefill"));
    let checksums = checksums.to_string();
    let router = router_over(&decode, &prefill, &["--transfer-checksums", &checksums]);
    (router, vec![decode, prefill])
}

/// Runs `pdctl verify --json --model` against `router`; returns whether it succeeded and each
/// check's result by name.
fn verify(router: &Service) -> (bool, Vec<(String, String, String)>) {
    let mut cmd = command("pdctl");
    cmd.args([
        "verify",
        "--url",
        &router.addr("http").to_string(),
        "--model",
        &model_arg(),
        "--json",
    ]);
    let (status, stdout, stderr) = run_to_exit(cmd, Duration::from_secs(300));
    let report: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("verify printed no JSON ({e}): {stdout} {stderr}"));
    assert_eq!(
        report["ok"].as_bool(),
        Some(status.success()),
        "the exit status follows the report: {stdout} {stderr}"
    );
    let checks = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_owned(),
                c["result"].as_str().unwrap().to_owned(),
                c["detail"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    (status.success(), checks)
}

fn result_of<'a>(checks: &'a [(String, String, String)], name: &str) -> &'a str {
    checks.iter().find(|(n, ..)| n == name).map_or_else(
        || panic!("no check {name:?} in {checks:?}"),
        |(_, r, _)| r.as_str(),
    )
}

const REFERENCE: &str = "cluster == single-process engine";

#[test]
fn a_healthy_cluster_passes_every_check() {
    let (router, _workers) = cluster(None, true);
    let (ok, checks) = verify(&router);
    assert!(ok, "{checks:#?}");
    assert_eq!(checks.len(), 8);
    for (name, result, detail) in &checks {
        assert_eq!(result, "pass", "{name}: {detail}");
    }
}

/// Faults in the transferred state, with checksums off: the answers look plausible, are
/// repeatable and stream consistently, and only the comparison with the single-process
/// engine can tell. Verify must fail on it.
#[test]
fn corrupted_state_fails_the_reference_check() {
    for fault in ["flip-page-byte", "drop-slot", "swap-pages"] {
        let (router, _workers) = cluster(Some(fault), false);
        let (ok, checks) = verify(&router);
        assert!(!ok, "{fault}: verify passed: {checks:#?}");
        assert_eq!(
            result_of(&checks, REFERENCE),
            "fail",
            "{fault}: {checks:#?}"
        );
        assert_eq!(
            result_of(&checks, "transfer checksums"),
            "fail",
            "checksums are off"
        );
        assert_eq!(
            result_of(&checks, "greedy determinism"),
            "pass",
            "{fault}: the fault is deterministic, so only the reference catches it"
        );
    }
}

/// With checksums on, the decode worker refuses the corrupted state: requests fail with an
/// error instead of answering, and verify fails.
#[test]
fn checksums_turn_corrupted_state_into_errors() {
    let (router, _workers) = cluster(Some("flip-page-byte"), true);
    let (ok, checks) = verify(&router);
    assert!(!ok);
    let (_, result, detail) = checks.iter().find(|(n, ..)| n == REFERENCE).unwrap();
    assert_eq!(result, "fail");
    assert!(detail.contains("checksum mismatch"), "{detail}");
}

/// Tokens handed to the wrong one of several concurrent requests: every request alone is
/// right, so only the concurrency check catches it.
#[test]
fn mixed_up_batches_fail_the_concurrency_check() {
    let (router, _workers) = cluster(Some("reorder-batch"), true);
    let (ok, checks) = verify(&router);
    assert!(!ok);
    assert_eq!(
        result_of(&checks, "concurrency isolation"),
        "fail",
        "{checks:#?}"
    );
    assert_eq!(result_of(&checks, REFERENCE), "pass", "{checks:#?}");
}

/// A decode worker with fast kernels (within stated bounds of the reference, not its bits)
/// reports them (`GET /workers`: `compute.fast_kernels`), and verify does not run a
/// bit-for-bit comparison that cannot hold: the reference check fails naming the worker and
/// its settings, while an exact worker's listing says it has none.
#[test]
fn fast_kernels_are_reported_and_refuse_the_bit_for_bit_check() {
    let fast = [
        "--page-size",
        "16",
        "--kv-cache-dtype",
        "fp8",
        "--backend",
        "emulated",
        "--decode-attention",
        "fast",
    ];
    let decode = Service::start(worker_command("pdserve-decode", &fast));
    let prefill = Service::start(worker_command(
        "pdserve-prefill",
        &["--page-size", "16", "--kv-cache-dtype", "fp8"],
    ));
    let router = router_over(&decode, &prefill, &["--transfer-checksums", "true"]);
    let listing = integration_tests::pd::listed(router.addr("http"));
    let compute = |role: &str| {
        listing
            .iter()
            .find(|w| w["role"] == role)
            .map(|w| w["compute"].clone())
            .unwrap()
    };
    let (d, p) = (compute("decode"), compute("prefill"));
    assert_eq!(d["backend"], "emulated", "{d}");
    assert_eq!(d["kv_cache_dtype"], "fp8", "{d}");
    assert_eq!(
        d["fast_kernels"],
        serde_json::json!(["decode_attention"]),
        "{d}"
    );
    assert!(
        d["plan"].as_str().unwrap().contains("fast attention"),
        "{d}"
    );
    assert_eq!(p["backend"], "cpu", "{p}");
    assert_eq!(p["fast_kernels"], serde_json::json!([]), "{p}");
    let (ok, checks) = verify(&router);
    assert!(!ok, "{checks:#?}");
    let (_, result, detail) = checks.iter().find(|(n, ..)| n == REFERENCE).unwrap();
    assert_eq!(result, "fail");
    assert!(
        detail.contains("decode") && detail.contains("decode_attention"),
        "{detail}"
    );
    assert!(detail.contains("not its bits"), "{detail}");
}
