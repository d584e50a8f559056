//! OTLP trace export: with `OTEL_EXPORTER_OTLP_ENDPOINT` set, the router and both workers send
//! their `request` spans to an OTLP/gRPC collector (here a minimal one in the test, speaking
//! the official protocol), each carrying the request's `X-Request-Id`, all in one trace.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use integration_tests::{
    Service, http,
    pd::{chat, model_arg, worker_command},
};
use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
        trace_service_server::{TraceService, TraceServiceServer},
    },
    common::v1::any_value::Value,
};

/// (service name, span name, its `id` attribute, trace id) of every span received.
type Received = Arc<Mutex<Vec<(String, String, String, Vec<u8>)>>>;

#[derive(Default)]
struct Collector {
    spans: Received,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let text = |v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>| match v
            .as_ref()
            .and_then(|v| v.value.as_ref())
        {
            Some(Value::StringValue(s)) => s.clone(),
            _ => String::new(),
        };
        let mut spans = self.spans.lock().unwrap();
        for resource in request.into_inner().resource_spans {
            let service = resource
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .map(|a| text(&a.value))
                .unwrap_or_default();
            for span in resource.scope_spans.iter().flat_map(|s| &s.spans) {
                let id = span
                    .attributes
                    .iter()
                    .find(|a| a.key == "id")
                    .map(|a| text(&a.value))
                    .unwrap_or_default();
                spans.push((
                    service.clone(),
                    span.name.clone(),
                    id,
                    span.trace_id.clone(),
                ));
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// A collector on an ephemeral loopback port, served by its own runtime until the test ends.
fn collector() -> (String, Received, tokio::runtime::Runtime) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let spans = Received::default();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let service = TraceServiceServer::new(Collector {
        spans: spans.clone(),
    });
    runtime.spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (endpoint, spans, runtime)
}

fn exporting(mut cmd: std::process::Command, endpoint: &str) -> Service {
    cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env("PDSERVE_LOG", "info");
    Service::start(cmd)
}

#[test]
fn request_spans_reach_the_collector_with_the_request_id() {
    let (endpoint, spans, _runtime) = collector();
    let decode = exporting(worker_command("pdserve-decode", &[]), &endpoint);
    let prefill = exporting(worker_command("pdserve-prefill", &[]), &endpoint);
    let mut router = integration_tests::command("pdserve-router");
    router.args([
        "--http-listen",
        "127.0.0.1:0",
        "--grpc-listen",
        "127.0.0.1:0",
        "--model-dir",
        &model_arg(),
        "--decode-worker",
        &decode.addr("grpc").to_string(),
        "--prefill-worker",
        &prefill.addr("grpc").to_string(),
    ]);
    let router = exporting(router, &endpoint);
    let mut log = String::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !log.contains("exporting traces over OTLP") && Instant::now() < deadline {
        log.push_str(&router.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        log.contains("exporting traces over OTLP"),
        "the router says where traces go:\n{log}"
    );

    let body = serde_json::to_vec(&chat(5, 1, 0.0, 4)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let r = loop {
        let r = http(
            router.addr("http"),
            "POST",
            "/v1/chat/completions",
            &[("X-Request-Id", "otel-req-7")],
            &body,
            Duration::from_secs(30),
        );
        // The router may not have seen both workers ready yet.
        if r.status != 503 || Instant::now() > deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(r.status, 200, "{}", r.body);

    let wanted = ["pdserve-router", "pdserve-prefill", "pdserve-decode"];
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = spans.lock().unwrap().clone();
        // Trace ids of each process's `request` spans with the id (the router has one per
        // attempt: a 503 before the workers were ready is one).
        let traces_of = |service: &str| -> Vec<Vec<u8>> {
            got.iter()
                .filter(|(s, name, id, _)| s == service && name == "request" && id == "otel-req-7")
                .map(|(.., trace)| trace.clone())
                .collect()
        };
        let (router, prefill, decode) = (
            traces_of(wanted[0]),
            traces_of(wanted[1]),
            traces_of(wanted[2]),
        );
        // The workers' spans join the router's trace (W3C traceparent in the calls' metadata).
        let joined = prefill
            .iter()
            .any(|t| t.len() == 16 && decode.contains(t) && router.contains(t));
        if joined {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "one trace with the request spans of {wanted:?} and the request id; received {got:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
