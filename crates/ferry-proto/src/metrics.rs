//! What every component's Prometheus `/metrics` shares: the entry of a metric catalogue
//! ([`Family`]: name, type, help text, and a histogram's buckets), the bucket sets ([`Buckets`]),
//! the recorder built from a component's catalogue ([`install`]: every family described, so each
//! has `# HELP`, and each histogram bucketed as its family says) and the one content type every
//! `/metrics` answers with ([`CONTENT_TYPE`]).
//!
//! Each component keeps one catalogue, a module of `const` names with their families
//! (`ferry_router::metrics::names`, `ferry_worker::cluster::metrics::names`, and the connection
//! families here, [`crate::conn::Component::families`]); call sites use the constants, so the
//! names in code, tests and docs cannot drift apart. Naming follows Prometheus' rules (checked by
//! `promtool check metrics` in the tests): one prefix per component (`ferry_router_`,
//! `ferry_worker_`), base units in the name, `_total` on counters only.

use ::metrics::Unit;
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};

/// The content type of every `/metrics` answer: Prometheus' text format 0.0.4.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Histogram bucket sets. Times span a GPU's sub-millisecond steps to a CPU's seconds-long
/// prompts; counts of tokens, bytes and sequences get their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buckets {
    /// Per token or per step: inter-token latency, time per output token, an engine step, a KV
    /// transfer. 0.1 ms to 10 s.
    TokenSeconds,
    /// Per request: queue time, time to first token, end to end. 1 ms to 10 min.
    RequestSeconds,
    /// Tokens per request: 1 to 128 Ki, doubling.
    Tokens,
    /// Bytes per KV transfer: 4 KiB to 16 GiB, ×4.
    Bytes,
    /// Sequences per engine step: 1 to 512, doubling.
    Batch,
}

impl Buckets {
    /// The upper bounds.
    pub const fn bounds(self) -> &'static [f64] {
        match self {
            Buckets::TokenSeconds => &[
                0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0,
            ],
            Buckets::RequestSeconds => &[
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
                300.0, 600.0,
            ],
            Buckets::Tokens => &[
                1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0, 65536.0, 131072.0,
            ],
            Buckets::Bytes => &[
                4096.0,
                16384.0,
                65536.0,
                262144.0,
                1048576.0,
                4194304.0,
                16777216.0,
                67108864.0,
                268435456.0,
                1073741824.0,
                4294967296.0,
                17179869184.0,
            ],
            Buckets::Batch => &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0],
        }
    }

    /// The suffix the name of a histogram with these buckets ends in (its unit).
    pub const fn unit_suffix(self) -> &'static str {
        match self {
            Buckets::TokenSeconds | Buckets::RequestSeconds => "_seconds",
            Buckets::Tokens => "_tokens",
            Buckets::Bytes => "_bytes",
            Buckets::Batch => "_size",
        }
    }
}

/// A metric's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram(Buckets),
}

/// One metric family of a component's catalogue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Family {
    pub name: &'static str,
    pub kind: Kind,
    /// The `# HELP` text: what one sample means, with its unit.
    pub help: &'static str,
}

impl Family {
    pub const fn counter(name: &'static str, help: &'static str) -> Family {
        Family { name, kind: Kind::Counter, help }
    }

    pub const fn gauge(name: &'static str, help: &'static str) -> Family {
        Family { name, kind: Kind::Gauge, help }
    }

    pub const fn histogram(name: &'static str, buckets: Buckets, help: &'static str) -> Family {
        Family { name, kind: Kind::Histogram(buckets), help }
    }

    /// The unit the name ends in, for the recorder's description (names carry their unit
    /// already: the exporter is not asked to append it).
    pub fn unit(&self) -> Option<Unit> {
        let stem = self.name.strip_suffix("_total").unwrap_or(self.name);
        if stem.ends_with("_seconds") {
            Some(Unit::Seconds)
        } else if stem.ends_with("_bytes") {
            Some(Unit::Bytes)
        } else {
            None
        }
    }
}

/// Installs the process's Prometheus recorder for `catalogue` (every family described; each
/// histogram bucketed as its family says, any other as [`Buckets::RequestSeconds`]) and returns
/// its handle. When another recorder is installed already (several components in one test
/// process), that one keeps recording: the families are described to it, and the handle returned
/// renders this recorder's own, empty registry.
pub fn install(catalogue: &[&[Family]]) -> Result<PrometheusHandle, BuildError> {
    let mut builder = PrometheusBuilder::new().set_buckets(Buckets::RequestSeconds.bounds())?;
    for f in catalogue.iter().flat_map(|c| c.iter()) {
        if let Kind::Histogram(b) = f.kind {
            builder = builder.set_buckets_for_metric(Matcher::Full(f.name.to_string()), b.bounds())?;
        }
    }
    let recorder = builder.build_recorder();
    let handle = recorder.handle();
    if ::metrics::set_global_recorder(recorder).is_err() {
        tracing::debug!("a metrics recorder was already installed; it records this component's metrics");
    }
    describe(catalogue);
    Ok(handle)
}

/// Describes every family of `catalogue` to the installed recorder (its `# HELP` line).
pub fn describe(catalogue: &[&[Family]]) {
    for f in catalogue.iter().flat_map(|c| c.iter()) {
        match (f.kind, f.unit()) {
            (Kind::Counter, Some(u)) => ::metrics::describe_counter!(f.name, u, f.help),
            (Kind::Counter, None) => ::metrics::describe_counter!(f.name, f.help),
            (Kind::Gauge, Some(u)) => ::metrics::describe_gauge!(f.name, u, f.help),
            (Kind::Gauge, None) => ::metrics::describe_gauge!(f.name, f.help),
            (Kind::Histogram(_), Some(u)) => ::metrics::describe_histogram!(f.name, u, f.help),
            (Kind::Histogram(_), None) => ::metrics::describe_histogram!(f.name, f.help),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_bounds_rise() {
        for b in [Buckets::TokenSeconds, Buckets::RequestSeconds, Buckets::Tokens, Buckets::Bytes, Buckets::Batch] {
            assert!(b.bounds().windows(2).all(|w| w[0] < w[1]), "{b:?}");
        }
        // GPU and CPU speeds both land inside the time buckets, not in +Inf or the first bucket.
        assert!(Buckets::TokenSeconds.bounds()[0] <= 0.0001 && *Buckets::TokenSeconds.bounds().last().unwrap_or(&0.0) >= 10.0);
        assert!(*Buckets::RequestSeconds.bounds().last().unwrap_or(&0.0) >= 600.0);
    }

    #[test]
    fn units_from_names() {
        assert_eq!(Family::counter("a_bytes_total", "").unit(), Some(Unit::Bytes));
        assert_eq!(Family::histogram("a_seconds", Buckets::TokenSeconds, "").unit(), Some(Unit::Seconds));
        assert_eq!(Family::gauge("a_blocks", "").unit(), None);
    }
}
