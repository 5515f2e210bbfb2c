//! W3C Trace Context (`traceparent`, `tracestate`) across Ferry's hops: read from a client's
//! HTTP headers or gRPC metadata, and written into the metadata of every call a request makes
//! (router -> decode worker, router -> prefill worker), so that one request's spans in every
//! process form one trace. The propagator is OpenTelemetry's standard `TraceContextPropagator`:
//! a malformed `traceparent` reads as none (a new trace starts), never as an error; `tracestate`
//! is passed on as it came, never interpreted.
//!
//! All of it is off until the binary installs an OpenTelemetry layer and calls [`enable`]: with
//! tracing off, [`Parent::from_headers`] reads nothing and [`inject`] writes nothing.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::codegen::http::HeaderMap;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;

static ON: AtomicBool = AtomicBool::new(false);

/// Turns propagation on (the process exports spans).
pub fn enable() {
    ON.store(true, Relaxed);
}

/// Whether this process exports spans.
pub fn on() -> bool {
    ON.load(Relaxed)
}

/// A caller's span, read from a request's headers: the parent of the spans made for it. Empty
/// when tracing is off, when the caller sent none, or when what it sent is malformed.
#[derive(Clone, Debug, Default)]
pub struct Parent(Option<Context>);

impl Parent {
    /// Reads `traceparent` (and `tracestate`) from HTTP headers or gRPC metadata (whose
    /// [`MetadataMap::as_ref`] is its headers).
    pub fn from_headers(headers: &HeaderMap) -> Parent {
        let sent = headers.get("traceparent").and_then(|v| v.to_str().ok());
        if !on() || !sent.is_some_and(well_formed) {
            return Parent(None);
        }
        let cx = TraceContextPropagator::new().extract(&Headers(headers));
        Parent(cx.span().span_context().is_valid().then_some(cx))
    }

    /// Reads a `traceparent` carried in a message rather than in headers (`KvBegin.traceparent`).
    pub fn from_traceparent(traceparent: &str) -> Parent {
        let mut h = HeaderMap::new();
        match traceparent.parse() {
            Ok(v) if !traceparent.is_empty() => {
                h.insert("traceparent", v);
                Parent::from_headers(&h)
            }
            _ => Parent(None),
        }
    }

    /// Makes `span` a child of the caller's span (nothing when there is none: `span` stays the
    /// root of a new trace, or the child of the span it was made in).
    pub fn adopt(&self, span: &tracing::Span) {
        if let Some(cx) = &self.0 {
            // Fails only when no OpenTelemetry layer is installed: then there is nothing to do.
            let _ = span.set_parent(cx.clone());
        }
    }

    /// The caller's trace id (32 hex digits), for logs and tests.
    pub fn trace_id(&self) -> Option<String> {
        self.0.as_ref().map(|cx| cx.span().span_context().trace_id().to_string())
    }
}

/// Writes `span`'s context into a call's metadata (`traceparent`, and `tracestate` when the
/// trace has one), so that the callee's spans are its children.
pub fn inject(span: &tracing::Span, metadata: &mut MetadataMap) {
    if !on() {
        return;
    }
    let cx = span.context();
    if cx.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(&cx, &mut Metadata(metadata));
    }
}

/// `span`'s `traceparent`, for a message that carries it itself (empty when tracing is off).
pub fn traceparent(span: &tracing::Span) -> String {
    if !on() {
        return String::new();
    }
    let mut h = MetadataMap::new();
    inject(span, &mut h);
    h.get("traceparent").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned()
}

/// `request` with `span`'s context in its metadata ([`inject`]).
pub fn request<T>(span: &tracing::Span, message: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    inject(span, r.metadata_mut());
    r
}

/// The W3C `traceparent` grammar, checked exactly (the propagator alone would take a short
/// trace id): `version-traceid-parentid-flags` in lowercase hex of 2, 32, 16 and 2 digits;
/// version 00 ends there, a later version may go on after a `-`. The propagator checks the rest
/// (version ff, all-zero ids).
fn well_formed(v: &str) -> bool {
    let b = v.as_bytes();
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c));
    b.len() >= 55
        && hex(0..2)
        && b[2] == b'-'
        && hex(3..35)
        && b[35] == b'-'
        && hex(36..52)
        && b[52] == b'-'
        && hex(53..55)
        && (b.len() == 55 || (&b[..2] != b"00" && b[55] == b'-'))
}

struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

struct Metadata<'a>(&'a mut MetadataMap);

impl Injector for Metadata<'_> {
    fn set(&mut self, key: &str, value: String) {
        // The propagator writes only its own two keys and values it formatted; a value it cannot
        // write as ASCII metadata (a `tracestate` received elsewhere) is dropped.
        if let (Ok(k), Ok(v)) = (MetadataKey::from_bytes(key.as_bytes()), MetadataValue::try_from(value.as_str())) {
            self.0.insert(k, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().expect("header value"));
        }
        h
    }

    #[test]
    fn a_malformed_traceparent_reads_as_none() {
        enable();
        let good = Parent::from_headers(&headers(&[("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]));
        assert_eq!(good.trace_id().as_deref(), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
        for bad in [
            "",
            "garbage",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e47-00f067aa0ba902b7-01",
            "00-zzf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            let p = Parent::from_headers(&headers(&[("traceparent", bad), ("tracestate", "a=b")]));
            assert!(p.trace_id().is_none(), "{bad:?} was accepted");
        }
    }
}
