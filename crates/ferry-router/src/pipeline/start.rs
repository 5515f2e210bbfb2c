//! The pipeline's entry, shared by both client APIs: a request checked and converted at its
//! API's edge (an [`Intake`]: sampling converted to Ferry's types and validated there, once)
//! gets the checks that need the cluster (the prompt against the workers' context, the grammar
//! compiled as a worker would, workers ready), then a task of its own ([`crate::pipeline::run`]).

use std::sync::Arc;
use std::time::Instant;

use ferry_core::SamplingParams;
use ferry_proto::v1;
use tokio::sync::mpsc;
use tonic::Status;
use tracing::Instrument;

use crate::RouterError;
use crate::pipeline::drive::run;
use crate::pipeline::request::Job;
use crate::state::Shared;

/// Longest `cache_salt` a client may send (bytes).
pub const MAX_CACHE_SALT: usize = 256;

/// A request as a client API hands it to the pipeline.
#[derive(Debug)]
pub struct Intake {
    /// The client's id, checked ([`ferry_proto::request_id::check`]), or a fresh one.
    pub request_id: String,
    pub prompt: Vec<u32>,
    /// Converted from the API's fields and validated at its edge.
    pub params: SamplingParams,
    /// The client's cache salt (at most [`MAX_CACHE_SALT`] bytes, checked at the edge).
    pub cache_salt: String,
    /// When the request arrived (its TTFT counts from here).
    pub arrived: Instant,
    /// The request's root span ([`request_span`]), made at the API's edge.
    pub span: tracing::Span,
}

/// The request's root span on the router, a child of the client's span when it sent one (its
/// `traceparent`, read only when tracing is on). Its phases (queue, admission, prefill, decode)
/// are children, and so are the workers' spans for it (their calls carry its context).
pub fn request_span(request_id: &str, parent: &ferry_proto::trace::Parent) -> tracing::Span {
    let span = tracing::info_span!("request", request_id = %request_id, prompt_tokens = tracing::field::Empty, max_tokens = tracing::field::Empty);
    parent.adopt(&span);
    span
}

/// The client's request id, checked, or a fresh random one.
pub fn request_id(given: &str) -> Result<String, RouterError> {
    // Checked before anything logs it or a span carries it.
    ferry_proto::request_id::check(given).map_err(|e| RouterError::InvalidRequest(e.to_string()))?;
    Ok(if given.is_empty() { format!("{:016x}", rand::random::<u64>()) } else { given.to_owned() })
}

/// A request refused before it started: counted as invalid in the request metrics.
pub fn refused(e: RouterError) -> RouterError {
    crate::metrics::request_outcome("invalid");
    e
}

/// Compiles a request's grammar as a worker would (limits, compile, first mask), on the grammar
/// pool's threads, never this runtime's (issue 32). A full pool is a retryable refusal.
pub async fn check_grammar(shared: &Shared, grammar: &ferry_core::sampling::OutputGrammar) -> Result<(), RouterError> {
    use ferry_grammar::GrammarError as G;
    shared.grammars.check(grammar).await.map_err(|e| match e {
        G::Busy { waited_ms } => RouterError::GrammarBusy { waited_ms, retry_after_s: 1 },
        e @ (G::Tokenizer(_) | G::Invalid { .. } | G::Limit { .. } | G::Timeout { .. } | G::Panicked { .. } | G::Threads(_) | G::Matcher(_)) => {
            RouterError::InvalidGrammar(e)
        }
    })
}

/// A request that passed validation and now runs in its own task.
pub struct Started {
    pub request_id: String,
    /// The prompt's token ids (an `echo` answer names them).
    pub prompt: Vec<u32>,
    /// Deltas, then one final message or one error status. Dropping it cancels the request.
    pub events: mpsc::Receiver<Result<v1::GenerateResponse, Status>>,
}

/// Starts a request the client API checked: its prompt against the workers' context, its
/// grammar, whether workers are ready; then [`run`] in a task of its own. Refusals are counted
/// in the request metrics. `tenant`: the API key's tenant, when keys are on (its prompts share
/// cached KV only with each other).
pub async fn start(shared: &Arc<Shared>, intake: Intake, tenant: Option<&ferry_core::Tenant>) -> Result<Started, RouterError> {
    let Intake { request_id, prompt, params, cache_salt, arrived, span } = intake;
    span.record("prompt_tokens", prompt.len()).record("max_tokens", params.max_tokens);
    if prompt.is_empty() {
        return Err(refused(RouterError::InvalidRequest("the prompt has no tokens".into())));
    }
    if let Some(ctx) = shared.registry.max_context()
        && prompt.len() >= ctx as usize
    {
        return Err(refused(RouterError::InvalidRequest(format!("the prompt has {} tokens but the context is {ctx}", prompt.len()))));
    }
    if let Some(g) = &params.grammar {
        check_grammar(shared, g).instrument(span.clone()).await.map_err(refused)?;
    }
    let ready = shared.registry.ready();
    if !ready.can_serve() {
        crate::metrics::request_outcome("unavailable");
        let role = if ready.prefill == 0 { ferry_core::WorkerRole::Prefill } else { ferry_core::WorkerRole::Decode };
        return Err(RouterError::NoWorker { role });
    }
    let (tx, events) = mpsc::channel(64);
    let job = Job {
        request_id: request_id.clone(),
        prompt: prompt.clone(),
        params,
        cache_salt: ferry_core::prefix_cache::cache_salt(tenant, cache_salt.as_bytes()),
        start: arrived,
    };
    tokio::spawn(run(shared.clone(), job, tx).instrument(span));
    Ok(Started { request_id, prompt, events })
}
