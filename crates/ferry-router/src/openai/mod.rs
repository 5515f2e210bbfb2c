//! The OpenAI-compatible HTTP API on the router: `POST /v1/completions`,
//! `POST /v1/chat/completions`, `GET /v1/models` and `GET /v1/models/{id}` (axum, HTTP/1.1), and
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

type St = State<Arc<Http>>;

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
async fn health(State(h): St) -> Response {
    let (p, d, c) = h.shared.registry.ready_counts();
    let serving = service::can_serve((p, d, c));
    let body = json!({
        "status": if serving { "ok" } else { "unavailable" },
        "prefill_workers": p,
        "decode_workers": d,
        "colocated_workers": c,
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

async fn tokenize_route(State(h): St, body: Result<Bytes, BytesRejection>) -> Response {
    answer(body.map_err(rejected).and_then(|b| tokenize::tokenize(&h.shared, &b)))
}

async fn detokenize_route(State(h): St, body: Result<Bytes, BytesRejection>) -> Response {
    answer(body.map_err(rejected).and_then(|b| tokenize::detokenize(&h.shared, &b)))
}

fn answer(r: Result<Value, ApiError>) -> Response {
    match r {
        Ok(v) => json_ok(&v),
        Err(e) => e.into_response(),
    }
}

/// A body axum could not read (too large, not UTF-8 where it must be, …).
fn rejected(r: BytesRejection) -> ApiError {
    ApiError {
        status: r.status(),
        message: r.body_text(),
        param: None,
        code: None,
        retry_after: None,
    }
}

/// Serves [`router`] on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    keys: ApiKeys,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), crate::RouterError> {
    use axum::serve::ListenerExt;
    // Small SSE chunks must not wait for delayed ACKs.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router(shared, keys))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|source| crate::RouterError::Io {
            what: "serving the HTTP API",
            source,
        })
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
        message: format!("no route {} {}", req.method(), req.uri().path()),
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

async fn models(State(h): St) -> Response {
    let data: Vec<Value> = h.shared.model_names().into_iter().map(|id| model_object(&h, id)).collect();
    json_ok(&json!({"object": "list", "data": data}))
}

async fn model(State(h): St, Path(id): Path<String>) -> Response {
    if h.shared.serves(&id) {
        json_ok(&model_object(&h, &id))
    } else {
        ApiError::model_not_found(&id).into_response()
    }
}

/// The request's tenant, when API keys are on (set by [`require_key`]).
type TenantOf = Option<axum::Extension<Tenant>>;

async fn completions(State(h): St, tenant: TenantOf, body: Result<Bytes, BytesRejection>) -> Response {
    generate(&h, Kind::Completion, tenant, body).await
}

async fn chat(State(h): St, tenant: TenantOf, body: Result<Bytes, BytesRejection>) -> Response {
    generate(&h, Kind::Chat, tenant, body).await
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
    let echo = want.echo.then(|| logprobs::prompt_text(&h.shared, parsed.request.input.as_ref()));
    let started = service::start(&h.shared, parsed.request, tenant).map_err(|e| match (&e, parsed.structured_field) {
        // A grammar that does not compile is named by the field it came in.
        (crate::RouterError::InvalidGrammar(g), Some(field)) => ApiError::invalid(format!("`{field}`: {g}"), Some(field)),
        _ => ApiError::from(e),
    })?;
    if !parsed.tags.is_empty() {
        // `user`, `metadata`, …: the client's words about the request, for the logs only.
        tracing::info!(request_id = %started.request_id, tags = ?parsed.tags, "request tags");
    }
    let mut render = logprobs::Render::new(h.shared.clone(), kind, want, started.prompt.first().copied());
    let meta = Meta::new(
        kind,
        &started.request_id,
        unix_now(),
        parsed.model,
        parsed.include_usage,
    );
    let mut events = started.events;
    if !parsed.stream {
        let (text, fin, lps) = collect(&mut events).await?;
        let text = echo.unwrap_or_default() + &text;
        let mut v = match calls {
            Some(c) => {
                let (content, made) = c.whole(&text);
                response::complete_tools(&meta, &content, &made, &fin)
            }
            None => response::complete(&meta, &text, &fin),
        };
        v["choices"][0]["logprobs"] = render.whole(&lps);
        return Ok(json_ok(&v));
    }
    // Wait for the first event before answering 200, so that a request failing before its first
    // token still gets its own HTTP status.
    let first = match events.recv().await {
        Some(Ok(m)) => m,
        Some(Err(s)) => return Err(ApiError::from_status(&s)),
        None => return Err(ApiError::server("the request ended without an answer")),
    };
    // Echo without logprobs: the prompt's text leads (with them, it comes with their chunk).
    let (head, echo) = match (echo, render.wanted()) {
        (Some(p), false) => (Some(response::text_chunk(&meta, &p)), None),
        (echo, _) => (response::role_chunk(&meta), echo),
    };
    let mut sse = Sse { meta, render, echo, calls };
    let body = tokio_stream::iter(head.map(|v| response::sse(&v)))
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

/// The text, final message and logprobs of a request, or the error it ended with.
async fn collect(
    events: &mut tokio::sync::mpsc::Receiver<Result<v1::GenerateResponse, tonic::Status>>,
) -> Result<(String, v1::GenerateFinal, logprobs::Collected), ApiError> {
    let mut text = String::new();
    let mut lps = logprobs::Collected::default();
    while let Some(ev) = events.recv().await {
        match ev.map_err(|s| ApiError::from_status(&s))?.event {
            Some(Event::Delta(d)) => {
                text.push_str(&d.text);
                lps.push(&d);
            }
            Some(Event::Final(f)) => return Ok((text, f, lps)),
            None => {}
        }
    }
    Err(ApiError::server(
        "the request ended without a final message",
    ))
}

/// A streamed answer's state: its logprobs (they keep a text offset), the prompt's text to
/// echo with the prompt's logprobs, and the tool calls it is scanned for.
struct Sse {
    meta: Meta,
    render: logprobs::Render,
    echo: Option<String>,
    calls: Option<chat::Calls>,
}

impl Sse {
    /// The SSE bytes for one event of the request (empty for a delta with neither text nor
    /// logprobs). The final message and an error each end the stream with `[DONE]`.
    fn event(&mut self, ev: Result<v1::GenerateResponse, tonic::Status>) -> Bytes {
        if let Some(calls) = &mut self.calls {
            // (No logprobs here: the request refuses them on a stream with tools.)
            return tool_event(&self.meta, calls, ev);
        }
        let d = match &ev {
            Ok(v1::GenerateResponse { event: Some(Event::Delta(d)), .. }) => d,
            _ => return sse_event(&self.meta, ev),
        };
        if !self.render.wanted() {
            return sse_event(&self.meta, ev);
        }
        let (text, lp) = match logprobs::is_prompt_delta(d) {
            true => match self.echo.take() {
                Some(text) => (text, self.render.render(Some(&d.prompt_logprobs), &[])),
                None => return Bytes::new(),
            },
            false if d.text.is_empty() && d.logprobs.is_empty() => return Bytes::new(),
            false => (d.text.clone(), self.render.render(None, &d.logprobs)),
        };
        let mut chunk = response::text_chunk(&self.meta, &text);
        chunk["choices"][0]["logprobs"] = lp;
        response::sse(&chunk)
    }
}

/// The SSE bytes for one event of a request scanned for tool calls: content and calls as the
/// text completes them; at the end, what the scanner held, then the finish (`"tool_calls"` when
/// the model called).
fn tool_event(meta: &Meta, calls: &mut chat::Calls, ev: Result<v1::GenerateResponse, tonic::Status>) -> Bytes {
    let said = match &ev {
        Ok(v1::GenerateResponse { event: Some(Event::Delta(d)), .. }) => calls.push(&d.text),
        Ok(v1::GenerateResponse { event: Some(Event::Final(_)), .. }) => calls.finish(),
        _ => Vec::new(),
    };
    let mut out = Vec::new();
    for s in said {
        match s {
            chat::Said::Text(t) => out.extend_from_slice(&response::sse(&response::text_chunk(meta, &t))),
            chat::Said::Call(i, c) => {
                for chunk in response::tool_call_chunks(meta, i, &c) {
                    out.extend_from_slice(&response::sse(&chunk));
                }
            }
        }
    }
    match ev {
        Ok(v1::GenerateResponse { event: Some(Event::Final(f)), .. }) => {
            for c in response::final_chunks_after_calls(meta, &f, calls.count()) {
                out.extend_from_slice(&response::sse(&c));
            }
            out.extend_from_slice(response::DONE);
        }
        Ok(_) => {}
        Err(e) => out.extend_from_slice(&sse_event(meta, Err(e))),
    }
    Bytes::from(out)
}

/// The SSE bytes for one event of the request (empty for a delta without text). The final
/// message and an error each end the stream with `[DONE]`.
fn sse_event(meta: &Meta, ev: Result<v1::GenerateResponse, tonic::Status>) -> Bytes {
    match ev {
        Ok(v1::GenerateResponse {
            event: Some(Event::Delta(d)),
            ..
        }) if !d.text.is_empty() => response::sse(&response::text_chunk(meta, &d.text)),
        Ok(v1::GenerateResponse {
            event: Some(Event::Final(f)),
            ..
        }) => {
            let mut out = Vec::new();
            for c in response::final_chunks(meta, &f) {
                out.extend_from_slice(&response::sse(&c));
            }
            out.extend_from_slice(response::DONE);
            Bytes::from(out)
        }
        Ok(_) => Bytes::new(),
        Err(s) => {
            let mut out = response::sse(&ApiError::from_status(&s).body()).to_vec();
            out.extend_from_slice(response::DONE);
            Bytes::from(out)
        }
    }
}
