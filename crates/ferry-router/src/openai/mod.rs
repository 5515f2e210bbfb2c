//! The OpenAI-compatible HTTP API on the router: `POST /v1/completions`,
//! `POST /v1/chat/completions`, `GET /v1/models` and `GET /v1/models/{id}` (axum, HTTP/1.1).
//!
//! Each request is parsed ([`request`]) into Ferry's `GenerateRequest` and started through
//! [`service::start`], the same path as the gRPC `Generate`; its events become one JSON answer or
//! server-sent events ([`response`]). A client that goes away drops the event receiver, which
//! cancels the request on its workers. Errors answer in OpenAI's JSON shape ([`error`]).

pub mod error;
pub mod logprobs;
pub mod request;
pub mod response;

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

/// The HTTP API's routes, every one behind the API-key check when keys are configured.
pub fn router(shared: Arc<Shared>, keys: ApiKeys) -> Router {
    let state = Arc::new(Http {
        shared,
        created: unix_now(),
    });
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .fallback(not_found)
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(keys, require_key))
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
    let body = body.map_err(|r| ApiError {
        status: r.status(),
        message: r.body_text(),
        param: None,
        code: None,
        retry_after: None,
    })?;
    let parsed = request::parse(kind, &body)?;
    if !h.shared.serves(&parsed.model) {
        return Err(ApiError::model_not_found(&parsed.model));
    }
    let want = parsed.logprobs;
    let echo = want.echo.then(|| logprobs::prompt_text(&h.shared, parsed.request.input.as_ref()));
    let started = service::start(&h.shared, parsed.request, tenant)?;
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
        let mut v = response::complete(&meta, &text, &fin);
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
    let mut sse = Sse { meta, render, echo };
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

/// A streamed answer's state: its logprobs (they keep a text offset) and the prompt's text to
/// echo with the prompt's logprobs.
struct Sse {
    meta: Meta,
    render: logprobs::Render,
    echo: Option<String>,
}

impl Sse {
    /// The SSE bytes for one event of the request (empty for a delta with neither text nor
    /// logprobs). The final message and an error each end the stream with `[DONE]`.
    fn event(&mut self, ev: Result<v1::GenerateResponse, tonic::Status>) -> Bytes {
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
