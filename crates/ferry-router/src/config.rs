//! How the router runs ([`RouterConfig`]), as the CLI and tests set it.

use std::path::PathBuf;
use std::time::Duration;

use ferry_core::autoscale::Policy;
use ferry_core::sim::Fleet;

use ferry_proto::tls::Tls;

use crate::auth::{AdminToken, ApiKeys};
use crate::ops::scale::Scaler;
use crate::tools::format::Format;
use crate::workers::transport::KvPolicy;

/// How the router runs.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// The model (GGUF file or HF folder) whose tokenizer and chat template the router uses.
    pub model_path: PathBuf,
    /// A worker whose last heartbeat is older than this is dead.
    pub lease: Duration,
    /// How often workers are told to heartbeat.
    pub heartbeat: Duration,
    /// Times a request starts again on other workers after a failure before any output.
    pub max_retries: u32,
    /// Times a request that has streamed tokens moves to other workers (its prompt and the
    /// tokens so far prefilled again) when its decode worker dies or freezes.
    pub max_migrations: u32,
    /// Requests that may wait in the admission queue for room on a decode worker; beyond it
    /// they are refused (RESOURCE_EXHAUSTED / HTTP 429 with `Retry-After`).
    pub queue_max: usize,
    /// How long a request waits in the admission queue before it is refused the same way.
    pub queue_timeout: Duration,
    /// Deadline of a decode admission (the worker answers `admitted` at once or not at all).
    pub admit_timeout: Duration,
    /// Deadline of one prefill call (the prompt's computation and its KV transfer).
    pub prefill_timeout: Duration,
    /// Longest silence of a decode stream between two messages before the worker is taken as
    /// frozen and the request moves.
    pub token_timeout: Duration,
    /// Connect timeout for worker channels.
    pub connect_timeout: Duration,
    /// How long a decode worker waits for the KV after admission (zero: the worker's default).
    pub kv_timeout: Duration,
    /// Where `Admin.Scale` goes (None: scaling is refused with a clear error).
    pub scaler: Option<Scaler>,
    /// Keys the client APIs (gRPC `Ferry`, HTTP `/v1/*`) require; empty: open.
    pub api_keys: ApiKeys,
    /// The token `Admin` requires (unset: the cluster secret).
    pub admin_token: AdminToken,
    /// The cluster secret: `Registry` requires it, and every call to a worker or to the scaler
    /// carries it (open: none; the `ferry` commands never run open unless told to).
    pub cluster_secret: ferry_proto::ClusterSecret,
    /// The names clients may ask for the model by (`model` in requests); the first is the one
    /// reported. Empty: the model path's own name ([`ferry_tokenizer::served_name`]: the file
    /// stem without its quantisation, or the HF folder's name).
    pub served_model_names: Vec<String>,
    /// TLS: `server` on the gRPC listener (mutual TLS when it has a client CA), `client` when
    /// dialing workers and `ferry up`'s scaler. Default: plaintext both ways.
    pub tls: Tls,
    /// The fastest KV transport the router asks a pair to use (see [`transport`]).
    pub kv_transport: KvPolicy,
    /// Whether routing weighs the prompt prefixes workers hold (from their cache events), or
    /// load alone.
    pub prefix_routing: PrefixRouting,
    /// A decode worker that holds a prompt's prefix computes the rest itself (no prefill worker,
    /// no KV moved) when at most this many tokens are left; 0: never.
    pub local_prefill_max: usize,
    /// The format tool calls are parsed in (and forced calls written in) on the HTTP API; `None`:
    /// the one the model's chat template teaches ([`Format::detect`]).
    pub tool_call_parser: Option<Format>,
    /// The latency targets a finished request is held to: it counts toward goodput
    /// (`ferry_router_goodput_requests_total`) when it meets both; the autoscaler plans for them.
    pub slo: ferry_core::slo::Slo,
    /// Scale the pools from the SLOs (`--autoscale`; needs `scaler`). None: only by hand.
    pub autoscale: Option<AutoscaleConfig>,
    /// Open connections and header timeout of the gRPC and the HTTP API, each; `/metrics` gets
    /// [`ferry_proto::conn::DEFAULT_METRICS_MAX_CONNECTIONS`] with the same timeout.
    pub connections: ferry_proto::conn::ConnLimits,
}

/// How the router uses what it knows of the workers' prefix caches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefixRouting {
    /// Prefill: the expected finish time with each worker's cached prefix taken off the work;
    /// decode: a worker holding the prefix first while it has room (`ferry_core::cache_policy`).
    #[default]
    KvAware,
    /// Load alone (the workers still use their caches for what happens to land on them).
    LoadOnly,
}

/// The default `local_prefill_max`, measured (docs/benchmarks.md, "Prefix caching"): on a
/// multi-turn chat workload, computing a turn's short suffix on the decode worker that holds the
/// conversation halved TTFT against a round trip through a prefill worker (which must recompute
/// the previous answer), for a longer decode step there; 128 covers a chat turn's new message.
pub const DEFAULT_LOCAL_PREFILL_MAX: usize = 128;

impl RouterConfig {
    pub fn new(model_path: impl Into<PathBuf>) -> RouterConfig {
        RouterConfig {
            model_path: model_path.into(),
            lease: Duration::from_secs(3),
            heartbeat: Duration::from_secs(1),
            max_retries: 3,
            max_migrations: 3,
            queue_max: 256,
            queue_timeout: Duration::from_secs(30),
            admit_timeout: Duration::from_secs(10),
            prefill_timeout: Duration::from_secs(120),
            token_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(1),
            kv_timeout: Duration::ZERO,
            scaler: None,
            api_keys: ApiKeys::default(),
            admin_token: AdminToken::default(),
            cluster_secret: Default::default(),
            served_model_names: Vec::new(),
            tls: Tls::default(),
            kv_transport: KvPolicy::Auto,
            prefix_routing: PrefixRouting::KvAware,
            local_prefill_max: DEFAULT_LOCAL_PREFILL_MAX,
            tool_call_parser: None,
            slo: ferry_core::slo::Slo::DEFAULT,
            autoscale: None,
            connections: ferry_proto::conn::ConnLimits::api(),
        }
    }
}

/// How the autoscaler runs.
#[derive(Clone, Debug)]
pub struct AutoscaleConfig {
    pub interval: Duration,
    /// The arrival rate is measured over this much of the recent past (at least one interval):
    /// one interval of a few arrivals is a noisy estimate (at 0.6 requests/s, 10 s hold 6 ± 2.4),
    /// and plans from it move the pools back and forth.
    pub rate_window: Duration,
    pub policy: Policy,
    /// The workers, as `ferry profile` measured them.
    pub fleet: Fleet,
    /// Scale each role's steps by the workers' measured step time against the profile (false:
    /// plan at the profile's speed).
    pub calibrate: bool,
}
