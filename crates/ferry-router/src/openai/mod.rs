//! The OpenAI-compatible HTTP API on the router: `POST /v1/completions`,
//! `POST /v1/chat/completions`, `POST /v1/responses` ([`responses`]), `GET /v1/models` and `GET /v1/models/{id}` (axum, HTTP/1.1), and
//! beside them, as vLLM serves them, `POST /tokenize` and `POST /detokenize` ([`tokenize`]),
//! `GET /health` and `GET /metrics`.
//!
//! API keys guard `/v1/*` and the tokenizer endpoints. `/health` and `/metrics` stay open, as in
//! vLLM: probes and Prometheus scrape them without a key, and they say nothing of any request
//! (the worker counts and the same metrics the metrics listener serves).
//!
//! Each request is parsed ([`request`]) into Ferry's `GenerateRequest` (a chat's prompt rendered
//! with its tools, [`chat`]) and started through [`service::start`], the same path as the gRPC
//! `Generate`; its events become one JSON answer or server-sent events ([`response`]), with tool
//! calls scanned out of the text ([`tools`]). A client that goes away drops the event receiver, which
//! cancels the request on its workers. Errors answer in OpenAI's JSON shape ([`error`]).

pub mod chat;
pub mod error;
pub mod fields;
pub mod logprobs;
pub mod messages;
pub mod request;
pub mod response;
pub mod responses;
pub mod strict;
pub mod structured;
pub mod tokenize;
pub mod tools;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use ferry_proto::v1::{self, generate_response::Event};
use serde_json::{Value, json};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

use crate::auth::{ApiKeys, Tenant};
use crate::service::{self, Shared};
use error::ApiError;
use request::Kind;
use response::Meta;

struct Http {
    shared: Arc<Shared>,
    /// When this router started (unix seconds): the `created` of its one model.
    created: u64,
}

type HttpState = State<Arc<Http>>;

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The HTTP API's routes: `/v1/*` and the tokenizer endpoints behind the API-key check when keys
/// are configured, `/health` and `/metrics` open.
pub fn router(shared: Arc<Shared>, keys: ApiKeys) -> Router {
    let state = Arc::new(Http {
        shared,
        created: unix_now(),
    });
    let keyed = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/responses", post(responses_route))
        .route("/v1/models", get(models))
        // `{*id}`: a name may hold a `/` (`org/name`, as the HF hub names models).
        .route("/v1/models/{*id}", get(model))
        .route("/tokenize", post(tokenize_route))
        .route("/detokenize", post(detokenize_route))
        // Behind the key too: without one, no route is told apart from another.
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(keys, require_key));
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(keyed)
        .with_state(state)
}

/// `GET /health`: 200 when the cluster can serve a request (the gRPC `Health` test), else 503;
/// either way the ready worker counts.
async fn health(State(h): HttpState) -> Response {
    let ready = h.shared.registry.ready();
    let serving = ready.can_serve();
    let body = json!({
        "status": if serving { "ok" } else { "unavailable" },
        "prefill_workers": ready.prefill,
        "decode_workers": ready.decode,
        "colocated_workers": ready.colocated,
    });
    let status = if serving {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, json_ok(&body)).into_response()
}

/// `GET /metrics`: the Prometheus text the metrics listener serves.
async fn metrics() -> Response {
    match crate::metrics::handle() {
        Ok(h) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            h.render(),
        )
            .into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

async fn tokenize_route(State(h): HttpState, body: Result<Bytes, BytesRejection>) -> Response {
    answer(body.map_err(rejected).and_then(|b| tokenize::tokenize(&h.shared, &b)))
}

async fn detokenize_route(State(h): HttpState, body: Result<Bytes, BytesRejection>) -> Response {
    answer(body.map_err(rejected).and_then(|b| tokenize::detokenize(&h.shared, &b)))
}

fn answer(r: Result<Value, ApiError>) -> Response {
    match r {
        Ok(v) => json_ok(&v),
        Err(e) => e.into_response(),
    }
}

/// A body axum could not read (too large, not UTF-8 where it must be, not in within the body
/// timeout: 408, [`ferry_proto::conn::TimedBody`]).
fn rejected(r: BytesRejection) -> ApiError {
    let timed_out = std::iter::successors(Some(&r as &dyn std::error::Error), |e| e.source()).find_map(|e| e.downcast_ref::<ferry_proto::conn::BodyTimedOut>());
    if let Some(t) = timed_out {
        return ApiError { status: StatusCode::REQUEST_TIMEOUT, message: t.to_string(), param: None, code: None, retry_after: None };
    }
    ApiError {
        status: r.status(),
        message: r.body_text(),
        param: None,
        code: None,
        retry_after: None,
    }
}

/// Serves [`router`] on `listener` until `shutdown`, within the connection limits of
/// `shared.cfg.connections` ([`ferry_proto::conn`]: a cap on open connections, a header timeout;
/// Nagle off, so small SSE chunks do not wait for delayed ACKs).
pub async fn serve(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    keys: ApiKeys,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), crate::RouterError> {
    let acceptor = ferry_proto::conn::Acceptor::new(listener, "router_http", shared.cfg.connections);
    ferry_proto::conn::serve_http(acceptor, router(shared, keys), shutdown).await;
    Ok(())
}

async fn require_key(State(keys): State<ApiKeys>, mut req: Request, next: Next) -> Response {
    let header = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    match keys.check(header) {
        Ok(tenant) => {
            if let Some(t) = tenant {
                req.extensions_mut().insert(t);
            }
            next.run(req).await
        }
        Err(f) => {
            crate::metrics::auth_failure("http");
            ApiError::auth(f).into_response()
        }
    }
}

async fn not_found(req: Request) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("no route {} {}", req.method(), crate::error::clip(req.uri().path())),
        param: None,
        code: None,
        retry_after: None,
    }
}

fn model_object(h: &Http, id: &str) -> Value {
    json!({
        "id": id,
        "object": "model",
        "created": h.created,
        "owned_by": "ferry",
    })
}

fn json_ok(v: &Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

async fn models(State(h): HttpState) -> Response {
    let data: Vec<Value> = h.shared.model_names().into_iter().map(|id| model_object(&h, id)).collect();
    json_ok(&json!({"object": "list", "data": data}))
}

async fn model(State(h): HttpState, Path(id): Path<String>) -> Response {
    if h.shared.serves(&id) {
        json_ok(&model_object(&h, &id))
    } else {
        ApiError::model_not_found(&id).into_response()
    }
}

/// The request's tenant, when API keys are on (set by [`require_key`]).
type TenantOf = Option<axum::Extension<Tenant>>;

async fn completions(State(h): HttpState, tenant: TenantOf, body: Result<Bytes, BytesRejection>) -> Response {
    generate(&h, Kind::Completion, tenant, body).await
}

async fn chat(State(h): HttpState, tenant: TenantOf, body: Result<Bytes, BytesRejection>) -> Response {
    generate(&h, Kind::Chat, tenant, body).await
}

async fn responses_route(State(h): HttpState, tenant: TenantOf, body: Result<Bytes, BytesRejection>) -> Response {
    let tenant = tenant.map(|t| t.0);
    let r = match body {
        Ok(b) => responses::run(&h.shared, tenant.as_ref(), &b).await,
        Err(e) => Err(rejected(e)),
    };
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn generate(h: &Http, kind: Kind, tenant: TenantOf, body: Result<Bytes, BytesRejection>) -> Response {
    match run(h, kind, tenant.map(|t| t.0).as_ref(), body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(
    h: &Http,
    kind: Kind,
    tenant: Option<&Tenant>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(rejected)?;
    let mut parsed = request::parse(kind, &body)?;
    if !h.shared.serves(&parsed.model) {
        return Err(ApiError::model_not_found(&parsed.model));
    }
    let calls = match kind {
        Kind::Chat => chat::prepare(&h.shared, &mut parsed)?,
        Kind::Completion => None,
    };
    let want = parsed.logprobs;
    let n = parsed.request.sampling.as_ref().map_or(1, |s| s.n.max(1));
    let echo = want.echo.then(|| logprobs::prompt_text(&h.shared, parsed.request.input.as_ref()));
    let started = service::start(&h.shared, parsed.request, tenant).await.map_err(|e| match (&e, parsed.structured_field) {
        // A grammar that does not compile is named by the field it came in.
        (crate::RouterError::InvalidGrammar(g), Some(field)) => ApiError::invalid(format!("`{field}`: {g}"), Some(field)),
        _ => ApiError::from(e),
    })?;
    if !parsed.tags.is_empty() {
        // `user`, `metadata`, …: the client's words about the request, for the logs only.
        tracing::info!(request_id = %started.request_id, tags = ?parsed.tags, "request tags");
    }
    let render = logprobs::Render::new(h.shared.clone(), kind, want, started.prompt.first().copied());
    let mut renders = vec![render; n as usize];
    let mut meta = Meta::new(
        kind,
        &started.request_id,
        unix_now(),
        parsed.model,
        parsed.include_usage,
    );
    if parsed.continuous_usage {
        meta = meta.with_running_usage(started.prompt.len() as u32);
    }
    let mut events = started.events;
    if !parsed.stream {
        let answers = collect(&mut events, n).await?;
        let whole: Vec<response::Whole> = answers
            .iter()
            .map(|a| {
                let text = echo.clone().unwrap_or_default() + &a.text;
                let (text, calls) = match &calls {
                    Some(c) => c.clone().whole(&text),
                    None => (text, Vec::new()),
                };
                response::Whole { text, calls, fin: a.fin.clone() }
            })
            .collect();
        let mut v = response::complete(&meta, &whole);
        for (i, (a, r)) in answers.iter().zip(&mut renders).enumerate() {
            v["choices"][i]["logprobs"] = r.whole(&a.logprobs);
        }
        return Ok(json_ok(&v));
    }
    // Wait for the first event before answering 200, so that a request failing before its first
    // token still gets its own HTTP status.
    let first = match events.recv().await {
        Some(Ok(m)) => m,
        Some(Err(s)) => return Err(ApiError::from_status(&s)),
        None => return Err(ApiError::server("the request ended without an answer")),
    };
    // Echo without logprobs: the prompt's text leads each choice (with them, it comes with their
    // chunk).
    let (head, echo): (Vec<Value>, _) = match (echo, renders[0].wanted()) {
        (Some(p), false) => ((0..n).map(|i| response::text_chunk(&meta, i, &p)).collect(), None),
        (echo, _) => ((0..n).filter_map(|i| response::role_chunk(&meta, i)).collect(), echo),
    };
    let calls = calls.map(|c| vec![c; n as usize]);
    let mut sse = Sse { meta, echo: vec![echo; n as usize], renders, calls, finals: Vec::new(), n };
    let body = tokio_stream::iter(head.into_iter().map(|v| response::sse(&v)))
        .chain(
            tokio_stream::once(Ok(first))
                .chain(ReceiverStream::new(events))
                .map(move |ev| sse.event(ev)),
        )
        .filter(|b| !b.is_empty())
        .map(Ok::<_, Infallible>);
    Ok((
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response())
}

/// One choice's answer, whole.
#[derive(Default)]
struct Answer {
    text: String,
    fin: v1::GenerateFinal,
    logprobs: logprobs::Collected,
}

/// The answers of a request's `n` choices, in order, or the error it ended with.
async fn collect(
    events: &mut tokio::sync::mpsc::Receiver<Result<v1::GenerateResponse, tonic::Status>>,
    n: u32,
) -> Result<Vec<Answer>, ApiError> {
    let mut answers: Vec<Answer> = (0..n).map(|_| Answer::default()).collect();
    let mut ended = 0;
    while let Some(ev) = events.recv().await {
        match ev.map_err(|s| ApiError::from_status(&s))?.event {
            Some(Event::Delta(d)) => {
                let a = choice_of(&mut answers, d.index)?;
                a.text.push_str(&d.text);
                a.logprobs.push(&d);
            }
            Some(Event::Final(f)) => {
                let index = f.index;
                choice_of(&mut answers, index)?.fin = f;
                ended += 1;
                if ended == n {
                    return Ok(answers);
                }
            }
            // Only the gRPC API scans calls into events; the HTTP API reads the text.
            Some(Event::ToolCall(_)) | None => {}
        }
    }
    Err(ApiError::server(
        "the request ended without a final message for every choice",
    ))
}

fn choice_of(answers: &mut [Answer], index: u32) -> Result<&mut Answer, ApiError> {
    let n = answers.len();
    answers
        .get_mut(index as usize)
        .ok_or_else(|| ApiError::server(format!("an answer for choice {index} of a request for {n}")))
}

/// A streamed answer's state: per choice, its logprobs (they keep a text offset), the prompt's
/// text to echo with the prompt's logprobs, and the tool calls it is scanned for (with active
/// tools); the finals so far (the usage sums them).
struct Sse {
    meta: Meta,
    renders: Vec<logprobs::Render>,
    echo: Vec<Option<String>>,
    calls: Option<Vec<crate::tools::calls::Calls>>,
    finals: Vec<v1::GenerateFinal>,
    n: u32,
}

impl Sse {
    /// The SSE bytes for one event of the request (empty for a delta with neither text nor
    /// logprobs). The last choice's final and an error each end the stream with `[DONE]`.
    fn event(&mut self, ev: Result<v1::GenerateResponse, tonic::Status>) -> Bytes {
        let ev = match ev {
            Ok(v1::GenerateResponse { event: Some(Event::Delta(d)), .. }) => return self.delta(d),
            Ok(v1::GenerateResponse { event: Some(Event::Final(f)), .. }) => f,
            Ok(_) => return Bytes::new(),
            Err(s) => return error_event(&ApiError::from_status(&s)),
        };
        let mut out = Vec::new();
        let mut made = 0;
        if let Some(calls) = self.calls.as_mut().and_then(|c| c.get_mut(ev.index as usize)) {
            // What the scanner held back, then the finish (`"tool_calls"` when the model called).
            let said = calls.finish();
            said_events(&self.meta, ev.index, said, &mut out);
            made = calls.count();
        }
        out.extend_from_slice(&response::sse(&response::finish_chunk(&self.meta, &ev, made)));
        self.finals.push(ev);
        if self.finals.len() as u32 >= self.n {
            if let Some(u) = response::usage_chunk(&self.meta, &self.finals) {
                out.extend_from_slice(&response::sse(&u));
            }
            out.extend_from_slice(response::DONE);
        }
        Bytes::from(out)
    }

    fn delta(&mut self, d: v1::TokenDelta) -> Bytes {
        self.meta.generated(d.token_ids.len());
        let i = d.index as usize;
        let (Some(render), Some(echo)) = (self.renders.get_mut(i), self.echo.get_mut(i)) else {
            return error_event(&ApiError::server(format!("a delta for choice {i} of a request for {}", self.n)));
        };
        if let Some(calls) = self.calls.as_mut().and_then(|c| c.get_mut(i)) {
            // Content and calls as the text completes them. (No logprobs: the request refuses
            // them on a stream with tools.)
            let mut out = Vec::new();
            said_events(&self.meta, d.index, calls.push(&d.text), &mut out);
            return Bytes::from(out);
        }
        if !render.wanted() {
            return match d.text.is_empty() {
                true => Bytes::new(),
                false => response::sse(&response::text_chunk(&self.meta, d.index, &d.text)),
            };
        }
        let (text, lp) = match logprobs::is_prompt_delta(&d) {
            true => match echo.take() {
                Some(text) => (text, render.render(Some(&d.prompt_logprobs), &[])),
                None => return Bytes::new(),
            },
            false if d.text.is_empty() && d.logprobs.is_empty() => return Bytes::new(),
            false => (d.text.clone(), render.render(None, &d.logprobs)),
        };
        let mut chunk = response::text_chunk(&self.meta, d.index, &text);
        chunk["choices"][0]["logprobs"] = lp;
        response::sse(&chunk)
    }
}

/// The SSE chunks of what choice `choice`'s tool-call scanner gave out: content, and each call
/// as OpenAI streams it (its id, type and name, then its arguments piece by piece).
fn said_events(meta: &Meta, choice: u32, said: Vec<crate::tools::calls::Said>, out: &mut Vec<u8>) {
    use crate::tools::calls::Said;
    for s in said {
        let chunk = match s {
            Said::Text(t) => response::text_chunk(meta, choice, &t),
            Said::Open { index, id, name } => response::call_open_chunk(meta, choice, index, &id, &name),
            Said::Args { index, text } => response::call_args_chunk(meta, choice, index, &text),
            Said::Close { .. } => continue,
        };
        out.extend_from_slice(&response::sse(&chunk));
    }
}

/// An error chunk, then `[DONE]`.
fn error_event(e: &ApiError) -> Bytes {
    let mut out = response::sse(&e.body()).to_vec();
    out.extend_from_slice(response::DONE);
    Bytes::from(out)
}
