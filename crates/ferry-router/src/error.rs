//! The router's one error type, and its exhaustive mappings to gRPC status codes and to HTTP
//! statuses (the OpenAI-compatible API). Whether a failed call to a worker moves the request
//! elsewhere is not decided here but by `ferry_core::failure::classify`, from the worker's status.

use std::borrow::Cow;
use std::path::PathBuf;

use axum::http::StatusCode;
use ferry_core::WorkerRole;
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// The request itself is wrong (empty or oversize prompt, bad ids, bad sampling values).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The request's structured output does not compile (a bad JSON schema, regex or grammar).
    #[error("invalid request: {field}: {0}", field = grammar_field(.0))]
    InvalidGrammar(#[source] ferry_grammar::GrammarError),
    /// Every grammar-compile thread is busy and the request waited its turn too long (retryable:
    /// 429 / RESOURCE_EXHAUSTED with `Retry-After`, like a full admission queue; the grammar itself
    /// was not judged).
    #[error("structured output: the grammar compiler is busy (waited {waited_ms} ms): retry in {retry_after_s} s")]
    GrammarBusy { waited_ms: u64, retry_after_s: u32 },
    #[error("unknown model {requested:?}: this router serves {served:?}")]
    UnknownModel { requested: String, served: String },
    #[error("no ready {role} worker")]
    NoWorker { role: WorkerRole },
    #[error(
        "every decode worker that could hold {need_blocks} KV blocks refused the request (tried {tried})"
    )]
    DecodeExhausted { need_blocks: u32, tried: usize },
    /// The admission queue is full: the client should come back later (`Retry-After`).
    #[error("the router's admission queue is full ({depth} of {max} waiting): retry in {retry_after_s} s")]
    QueueFull { depth: usize, max: usize, retry_after_s: u32 },
    /// The request waited the queue's timeout and no decode worker had room.
    #[error("no decode worker had room for the request within {waited_ms} ms in the admission queue: retry in {retry_after_s} s")]
    QueueTimeout { waited_ms: u64, retry_after_s: u32 },
    /// The request moved between workers as often as allowed and failed again.
    #[error("request {request_id}: gave up after {moves} moves to other workers (the limit): {last}")]
    MovesExhausted { request_id: String, moves: u32, last: Box<RouterError> },
    #[error(
        "worker {worker} serves model fingerprint {worker_fingerprint} but the pool's is {pool_fingerprint}"
    )]
    FingerprintMismatch {
        worker: String,
        worker_fingerprint: String,
        pool_fingerprint: String,
    },
    #[error("unknown worker {0:?} (register again)")]
    UnknownWorker(String),
    #[error("worker {0:?} is shutting down (draining to exit) and cannot be undrained")]
    ShuttingDown(String),
    #[error(
        "this router has no scaler: start it with --kube-scale (Kubernetes) or run it under `ferry up`"
    )]
    NoScaler,
    /// `Scaler::Kubernetes` asked of a router built without the `kube` feature.
    #[error("this router was built without Kubernetes support (the `kube` feature of ferry-router): --kube-scale is not available")]
    KubeNotCompiled,
    #[error("scaling through {backend}: {message}")]
    ScaleFailed { backend: String, message: String },
    #[error("invalid registration: {0}")]
    BadRegistration(String),
    /// A worker failed the request at the transport level (down, unreachable, reset).
    #[error("request {request_id}: {role} worker {worker} is unavailable: {message}")]
    WorkerUnavailable {
        role: WorkerRole,
        worker: String,
        request_id: String,
        message: String,
    },
    /// A worker answered the request with an error status of its own.
    #[error("request {request_id}: {role} worker {worker} failed: {message}")]
    WorkerFailed {
        role: WorkerRole,
        worker: String,
        request_id: String,
        code: Code,
        message: String,
    },
    #[error("request {request_id}: decode worker {worker} broke the protocol: {message}")]
    Protocol {
        worker: String,
        request_id: String,
        message: String,
    },
    #[error("opening the model's tokenizer at {path}: {source}")]
    LoadModel {
        path: PathBuf,
        #[source]
        source: ferry_tokenizer::TokenizerError,
    },
    #[error("tokenizing the request: {0}")]
    Tokenize(#[source] ferry_tokenizer::TokenizerError),
    #[error("worker address {addr:?} is invalid: {message}")]
    BadAddress { addr: String, message: String },
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("gRPC reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("metrics: {0}")]
    Metrics(String),
}

impl RouterError {
    /// Seconds a client should wait before trying again, for the refusals that say so.
    pub fn retry_after_s(&self) -> Option<u32> {
        match self {
            RouterError::QueueFull { retry_after_s, .. }
            | RouterError::QueueTimeout { retry_after_s, .. }
            | RouterError::GrammarBusy { retry_after_s, .. } => {
                Some(*retry_after_s)
            }
            _ => None,
        }
    }
}

/// Where a gRPC client set the grammar: `sampling.structured.<kind>` (the kind, when known).
fn grammar_field(e: &ferry_grammar::GrammarError) -> String {
    match e.kind() {
        Some(k) => format!("sampling.structured.{}", k.wire_field()),
        None => "sampling.structured".to_owned(),
    }
}

/// The most characters of a client's value that an error message echoes.
pub const ECHO_CHARS: usize = 100;
/// The most characters of any error message a client is sent: a gRPC status message travels in
/// HTTP/2 trailers, which a client refuses past its header-list limit (16 KiB by default).
pub const MAX_MESSAGE_CHARS: usize = 1024;

/// A client's value as an error may echo it: at most [`ECHO_CHARS`] characters, then `…`.
pub fn clip(s: &str) -> Cow<'_, str> {
    clip_to(s, ECHO_CHARS)
}

/// `s` cut to `max` characters, `…` marking the cut.
pub fn clip_to(s: &str, max: usize) -> Cow<'_, str> {
    ferry_core::text::clip(s, max)
}

/// The gRPC metadata key that carries [`RouterError::retry_after_s`] (the HTTP header's name).
pub const RETRY_AFTER_KEY: &str = "retry-after";

/// The `retry-after` seconds a status carries, if any.
pub fn retry_after_of(s: &Status) -> Option<u32> {
    s.metadata().get(RETRY_AFTER_KEY)?.to_str().ok()?.parse().ok()
}

impl From<RouterError> for Status {
    fn from(e: RouterError) -> Status {
        let mut status = Status::new(e.grpc_code(), clip_to(&e.to_string(), MAX_MESSAGE_CHARS));
        if let Some(s) = e.retry_after_s() {
            status.metadata_mut().insert(RETRY_AFTER_KEY, s.into());
        }
        status
    }
}

impl RouterError {
    /// The gRPC code this error answers with.
    pub fn grpc_code(&self) -> Code {
        match self {
            RouterError::InvalidRequest(_)
            | RouterError::InvalidGrammar(_)
            | RouterError::Tokenize(_)
            | RouterError::BadRegistration(_) => Code::InvalidArgument,
            RouterError::UnknownModel { .. } | RouterError::UnknownWorker(_) => Code::NotFound,
            RouterError::NoWorker { .. }
            | RouterError::WorkerUnavailable { .. }
            | RouterError::Protocol { .. } => Code::Unavailable,
            RouterError::DecodeExhausted { .. }
            | RouterError::QueueFull { .. }
            | RouterError::QueueTimeout { .. }
            | RouterError::GrammarBusy { .. } => Code::ResourceExhausted,
            RouterError::MovesExhausted { last, .. } => last.grpc_code(),
            RouterError::FingerprintMismatch { .. }
            | RouterError::ShuttingDown(_)
            | RouterError::NoScaler
            | RouterError::KubeNotCompiled => Code::FailedPrecondition,
            RouterError::ScaleFailed { .. } => Code::Unavailable,
            RouterError::WorkerFailed { code, .. } => *code,
            RouterError::BadAddress { .. } => Code::InvalidArgument,
            RouterError::LoadModel { .. }
            | RouterError::Serve(_)
            | RouterError::Reflection(_)
            | RouterError::Io { .. }
            | RouterError::Metrics(_) => Code::Internal,
        }
    }
}

impl RouterError {
    /// The HTTP status this error answers with on the OpenAI-compatible API.
    pub fn http_status(&self) -> StatusCode {
        match self {
            RouterError::InvalidRequest(_)
            | RouterError::InvalidGrammar(_)
            | RouterError::Tokenize(_)
            | RouterError::BadRegistration(_)
            | RouterError::BadAddress { .. } => StatusCode::BAD_REQUEST,
            RouterError::UnknownModel { .. } | RouterError::UnknownWorker(_) => {
                StatusCode::NOT_FOUND
            }
            RouterError::NoWorker { .. }
            | RouterError::WorkerUnavailable { .. }
            | RouterError::Protocol { .. }
            | RouterError::DecodeExhausted { .. }
            | RouterError::ScaleFailed { .. } => StatusCode::SERVICE_UNAVAILABLE,
            RouterError::QueueFull { .. } | RouterError::QueueTimeout { .. } | RouterError::GrammarBusy { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            RouterError::MovesExhausted { last, .. } => last.http_status(),
            RouterError::ShuttingDown(_) | RouterError::NoScaler | RouterError::KubeNotCompiled => StatusCode::CONFLICT,
            RouterError::FingerprintMismatch { .. }
            | RouterError::LoadModel { .. }
            | RouterError::Serve(_)
            | RouterError::Reflection(_)
            | RouterError::Io { .. }
            | RouterError::Metrics(_) => StatusCode::INTERNAL_SERVER_ERROR,
            RouterError::WorkerFailed { code, .. } => http_status_of(*code),
        }
    }
}

/// The HTTP status for a gRPC code (an error that reached the client stream as a `Status`).
pub fn http_status_of(code: Code) -> StatusCode {
    match code {
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
            StatusCode::BAD_REQUEST
        }
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        // RESOURCE_EXHAUSTED: no room now (the admission queue timed out or is full); OpenAI's
        // clients back off on 429 and read `Retry-After`.
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Ok | Code::Unknown | Code::Internal | Code::DataLoss => {
            StatusCode::INTERNAL_SERVER_ERROR
        }
    }
}
