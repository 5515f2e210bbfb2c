//! `--otlp-endpoint`: OpenTelemetry tracing for one process. With an endpoint, the process's
//! `tracing` spans from Ferry's crates (the request's phases: see docs/architecture.md,
//! "Tracing") are exported over OTLP/HTTP with protobuf to `{endpoint}/v1/traces` by a batch
//! processor on its own thread, with the resource's `service.name` (`ferry-router`,
//! `ferry-prefill`, `ferry-decode`, `ferry-worker`) and a `service.instance.id` of its own, and
//! W3C trace context is propagated on every call ([`ferry_proto::trace`]). Without one, no
//! OpenTelemetry layer is installed at all: the subscriber is the plain log formatter it always was.
//!
//! The HTTP client is [`PlainHttp`]: one blocking HTTP/1.1 POST per batch over a plain TCP
//! connection, run on the processor's thread (`http://` only; a collector on the node or in the
//! pod is the usual setup), so no TLS stack or second HTTP client enters the build.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, bail};
use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// How long a batch waits before it leaves (spans of a finished request reach the collector
/// within about this long).
const BATCH_DELAY: Duration = Duration::from_millis(500);
/// The longest one export may take (connect, send, answer).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(clap::Args, Clone, Debug, Default)]
pub struct OtlpArgs {
    /// Export OpenTelemetry traces over OTLP/HTTP (protobuf) to this collector, e.g.
    /// `http://127.0.0.1:4318` (spans go to `/v1/traces` under it). Unset: no tracing layer at all.
    #[arg(long, value_name = "http://HOST:PORT")]
    pub otlp_endpoint: Option<String>,
}

impl OtlpArgs {
    /// The flags that pass the same endpoint on to a process `ferry up` starts.
    pub fn to_args(&self) -> Vec<String> {
        match &self.otlp_endpoint {
            Some(e) => vec!["--otlp-endpoint".into(), e.clone()],
            None => Vec::new(),
        }
    }
}

/// The exporting half of the subscriber: dropping it (at the end of `main`) flushes the spans
/// still batched and stops the processor's thread.
pub struct Exporting(SdkTracerProvider);

impl Drop for Exporting {
    fn drop(&mut self) {
        if let Err(e) = self.0.shutdown() {
            eprintln!("warning: flushing the last spans to the OTLP endpoint: {e}");
        }
    }
}

/// Installs the global subscriber: the log formatter on stderr (filtered by `FERRY_LOG`,
/// default `warn`), and with `export` (`service.name`, endpoint) the OpenTelemetry layer.
pub fn init(export: Option<(&'static str, &str)>) -> anyhow::Result<Option<Exporting>> {
    let filter = EnvFilter::try_from_env("FERRY_LOG").unwrap_or_else(|_| "warn".into());
    let Some((service, endpoint)) = export else {
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
        return Ok(None);
    };
    let (authority, base) = parse_endpoint(endpoint)?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(format!("{base}/v1/traces"))
        .with_timeout(EXPORT_TIMEOUT)
        .with_http_client(PlainHttp { authority, timeout: EXPORT_TIMEOUT })
        .build()
        .context("building the OTLP span exporter")?;
    let instance = format!("{service}-{}-{:08x}", std::process::id(), rand::random::<u32>());
    let resource = Resource::builder().with_service_name(service).with_attribute(KeyValue::new("service.instance.id", instance)).build();
    let batch = BatchConfigBuilder::default().with_scheduled_delay(BATCH_DELAY).build();
    let provider = SdkTracerProvider::builder()
        .with_resource(resource)
        .with_span_processor(BatchSpanProcessor::builder(exporter).with_batch_config(batch).build())
        .build();
    // Ferry's own spans only (its crates' targets all start with `ferry`), at INFO and above:
    // one span per request phase, none per token.
    let spans = Targets::new().with_target("ferry", LevelFilter::INFO);
    let otel = tracing_opentelemetry::layer().with_tracer(provider.tracer("ferry")).with_filter(spans);
    tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_filter(filter))
        .with(otel)
        .init();
    ferry_proto::trace::enable();
    Ok(Some(Exporting(provider)))
}

/// `http://HOST:PORT[/PREFIX]` into (`HOST:PORT`, the URL without a trailing `/`).
fn parse_endpoint(endpoint: &str) -> anyhow::Result<(String, String)> {
    let Some(rest) = endpoint.strip_prefix("http://") else {
        bail!("--otlp-endpoint {endpoint:?}: only http:// endpoints are supported (run a collector next to the process)");
    };
    let authority = rest.split('/').next().unwrap_or_default();
    if authority.is_empty() || !authority.contains(':') {
        bail!("--otlp-endpoint {endpoint:?}: expected http://HOST:PORT");
    }
    Ok((authority.to_owned(), endpoint.trim_end_matches('/').to_owned()))
}

/// A minimal HTTP/1.1 client for the exporter: one POST per batch on a fresh connection
/// (`Connection: close`), blocking. The batch processor runs exports on its own thread under a
/// plain executor (`futures_executor::block_on`), never on a Tokio worker, so blocking here
/// stalls nothing else.
#[derive(Debug)]
struct PlainHttp {
    authority: String,
    timeout: Duration,
}

#[async_trait::async_trait]
impl HttpClient for PlainHttp {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let addr = self.authority.to_socket_addrs()?.next().ok_or_else(|| format!("{} resolves to no address", self.authority))?;
        let mut conn = TcpStream::connect_timeout(&addr, self.timeout)?;
        conn.set_read_timeout(Some(self.timeout))?;
        conn.set_write_timeout(Some(self.timeout))?;
        let path = request.uri().path_and_query().map_or("/", |p| p.as_str());
        let mut head = format!("POST {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n", self.authority, request.body().len());
        for (k, v) in request.headers() {
            if let Ok(v) = v.to_str() {
                head.push_str(&format!("{k}: {v}\r\n"));
            }
        }
        head.push_str("\r\n");
        conn.write_all(head.as_bytes())?;
        conn.write_all(request.body())?;
        let mut answer = Vec::new();
        conn.take(1 << 20).read_to_end(&mut answer)?;
        // `HTTP/1.1 200 OK`: the status is all the exporter reads.
        let status = answer
            .split(|&b| b == b'\r')
            .next()
            .and_then(|line| std::str::from_utf8(line).ok())
            .and_then(|line| line.split(' ').nth(1))
            .and_then(|code| code.parse::<u16>().ok())
            .ok_or("the OTLP endpoint's answer has no HTTP status line")?;
        Ok(Response::builder().status(status).body(Bytes::new())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_http_host_and_port() {
        assert_eq!(parse_endpoint("http://127.0.0.1:4318").unwrap(), ("127.0.0.1:4318".into(), "http://127.0.0.1:4318".into()));
        assert_eq!(parse_endpoint("http://collector:4318/").unwrap().1, "http://collector:4318");
        for bad in ["https://c:4318", "127.0.0.1:4318", "http://", "http://collector"] {
            assert!(parse_endpoint(bad).is_err(), "{bad}");
        }
    }
}
