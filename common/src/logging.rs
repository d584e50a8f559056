//! Logging to stderr, filtered by `PDSERVE_LOG` (default `info`), and, when an OTLP endpoint
//! is configured, the same spans exported to it as OpenTelemetry traces.
//!
//! Export is off by default. It follows OpenTelemetry's own variables, as every OTLP exporter
//! does: `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), e.g.
//! `http://collector:4317` (OTLP over gRPC), `OTEL_SERVICE_NAME` (default: the program name)
//! and the batch settings (`OTEL_BSP_SCHEDULE_DELAY`, ...). The router's `request{id}` span and
//! the workers' spans carry the request id, so a request's trace can be found by its
//! `X-Request-Id`; the router passes its trace context to the workers in each call's metadata
//! (W3C `traceparent`), so a request's spans on all three processes form one trace.

use std::collections::HashMap;

use opentelemetry::{propagation::TextMapPropagator as _, trace::TracerProvider as _};
use opentelemetry_sdk::{Resource, propagation::TraceContextPropagator, trace::SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::{
    EnvFilter, Layer as _, layer::SubscriberExt as _, util::SubscriberInitExt,
};

use crate::env;

/// OpenTelemetry's variables that turn trace export on.
const OTLP_ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
];

/// Keeps the trace exporter alive; dropping it sends the spans still buffered.
#[derive(Debug, Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            // Best effort: the collector may be gone; the process is ending either way.
            let _ = provider.shutdown();
        }
    }
}

/// Logging to stderr only (command-line tools): installs the global subscriber once.
pub fn init_stderr() {
    let _ = tracing_subscriber::registry()
        .with(filter())
        .with(stderr_layer())
        .try_init();
}

/// The stderr layer, in `PDSERVE_LOG_FORMAT`.
fn stderr_layer<S>() -> Box<dyn tracing_subscriber::Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let json = std::env::var(env::LOG_FORMAT).is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(true);
    if json {
        fmt.json().boxed()
    } else {
        fmt.boxed()
    }
}

/// The logging variables as a process starts (`PDSERVE_LOG`, `PDSERVE_LOG_FORMAT`): an error
/// where a filter does not parse or a format is neither `text` nor `json` (the logger would
/// otherwise fall back to `info` text without a word).
pub fn check_env() -> Result<(), String> {
    check_values(
        std::env::var(env::LOG).ok().as_deref(),
        std::env::var(env::LOG_FORMAT).ok().as_deref(),
    )
}

fn check_values(filter: Option<&str>, format: Option<&str>) -> Result<(), String> {
    if let Some(f) = filter.filter(|f| !f.trim().is_empty()) {
        EnvFilter::try_new(f)
            .map_err(|e| format!("{}={f:?} is not a log filter: {e}", env::LOG))?;
    }
    match format.filter(|f| !f.trim().is_empty()) {
        Some(f) if !f.eq_ignore_ascii_case("json") && !f.eq_ignore_ascii_case("text") => {
            Err(format!(
                "{}={f:?}: the log format is `text` or `json`",
                env::LOG_FORMAT
            ))
        }
        _ => Ok(()),
    }
}

/// `PDSERVE_LOG`'s filter, for the whole subscriber: the log and the exported spans follow
/// the same levels.
fn filter() -> EnvFilter {
    EnvFilter::try_from_env(env::LOG).unwrap_or_else(|_| EnvFilter::new("info"))
}

/// Installs the global subscriber once; later calls are no-ops (tests start several services).
/// Call it inside the tokio runtime the service runs on: the OTLP exporter's gRPC channel
/// lives there.
pub fn init(program: &str) -> Telemetry {
    let (provider, otel) = match otlp_provider(program) {
        Ok(Some(provider)) => {
            let tracer = provider.tracer("pdserve");
            let layer = tracing_opentelemetry::layer().with_tracer(tracer);
            (Some(provider), Some(layer))
        }
        Ok(None) => (None, None),
        Err(e) => {
            // Logging is not up yet: say it on stderr, and serve without export.
            #[expect(clippy::print_stderr, reason = "the logger is not installed yet")]
            {
                eprintln!("{program}: OTLP trace export disabled: {e}");
            }
            (None, None)
        }
    };
    // An already-installed subscriber is fine: keep the first one.
    let installed = tracing_subscriber::registry()
        .with(filter())
        .with(stderr_layer())
        .with(otel)
        .try_init()
        .is_ok();
    if let (true, Some(endpoint)) = (installed && provider.is_some(), otlp_endpoint()) {
        tracing::info!(%endpoint, "exporting traces over OTLP");
    }
    Telemetry {
        provider: provider.filter(|_| installed),
    }
}

/// The configured OTLP endpoint, if any.
fn otlp_endpoint() -> Option<String> {
    OTLP_ENDPOINT_VARS
        .iter()
        .find_map(|var| std::env::var(var).ok().filter(|v| !v.trim().is_empty()))
}

/// A batch exporter to the configured endpoint, or `None` when none is configured.
fn otlp_provider(
    program: &str,
) -> Result<Option<SdkTracerProvider>, opentelemetry_otlp::ExporterBuildError> {
    if otlp_endpoint().is_none() {
        return Ok(None);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()?;
    let service = std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| program.to_owned());
    Ok(Some(
        SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(Resource::builder().with_service_name(service).build())
            .build(),
    ))
}

/// W3C trace-context keys carried in gRPC metadata.
const TRACE_CONTEXT_KEYS: [&str; 2] = ["traceparent", "tracestate"];

/// Puts the current span's trace context (W3C `traceparent`, `tracestate`) into a gRPC call's
/// metadata, so the callee's spans join the caller's trace. Adds nothing when traces are not
/// exported (the span then has no trace context).
pub fn inject_trace_context(metadata: &mut tonic::metadata::MetadataMap) {
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&tracing::Span::current().context(), &mut carrier);
    for key in TRACE_CONTEXT_KEYS {
        if let Some(value) = carrier.get(key).and_then(|v| v.parse().ok()) {
            metadata.insert(key, value);
        }
    }
}

/// Makes `span` a child of the trace context a gRPC call carries, if it carries one.
pub fn join_trace(metadata: &tonic::metadata::MetadataMap, span: &tracing::Span) {
    let carrier: HashMap<String, String> = TRACE_CONTEXT_KEYS
        .iter()
        .filter_map(|key| {
            let value = metadata.get(*key)?.to_str().ok()?;
            Some(((*key).to_owned(), value.to_owned()))
        })
        .collect();
    if carrier.is_empty() {
        return;
    }
    // Fails only when spans are not exported: nothing to join then.
    let _ = span.set_parent(TraceContextPropagator::new().extract(&carrier));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_filter_or_format_is_an_error_not_a_fallback() {
        check_values(None, None).unwrap();
        check_values(Some("info,router=debug"), Some("JSON")).unwrap();
        check_values(Some(""), Some("text")).unwrap();
        let e = check_values(Some("info,router=loud"), None).unwrap_err();
        assert!(e.contains("PDSERVE_LOG="), "{e}");
        let e = check_values(None, Some("yaml")).unwrap_err();
        assert!(e.contains("PDSERVE_LOG_FORMAT"), "{e}");
    }
}
