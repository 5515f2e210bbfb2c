//! The HTTP API's server: routes, the API-key check, models, health, and the handlers that
//! hand each request to its endpoint ([`super::generate`], [`super::responses`],
//! [`super::tokenize`]).

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use crate::auth::{ApiKeys, Tenant};
use crate::state::Shared;
use super::error::ApiError;
use super::body::Kind;
use super::{generate, response, responses, tokenize};

struct Http {
    shared: Arc<Shared>,
    /// When this router started (unix seconds): the `created` of its one model.
    created: u64,
}

type HttpState = State<Arc<Http>>;

/// The HTTP API's routes: `/v1/*` and the tokenizer endpoints behind the API-key check when keys
/// are configured, `/health` and `/metrics` open.
pub fn router(shared: Arc<Shared>, keys: ApiKeys) -> Router {
    let state = Arc::new(Http {
        shared,
        created: response::unix_now(),
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
    (status, response::json_ok(&body)).into_response()
}

/// `GET /metrics`: the Prometheus text the metrics listener serves.
async fn metrics() -> Response {
    match crate::metrics::handle() {
        Ok(h) => crate::metrics::render(&h).into_response(),
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
        Ok(v) => response::json_ok(&v),
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
    let acceptor = ferry_proto::conn::Acceptor::new(listener, ferry_proto::conn::Server::RouterHttp, shared.cfg.connections);
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


async fn models(State(h): HttpState) -> Response {
    let data: Vec<Value> = h.shared.model_names().into_iter().map(|id| model_object(&h, id)).collect();
    response::json_ok(&json!({"object": "list", "data": data}))
}

async fn model(State(h): HttpState, Path(id): Path<String>) -> Response {
    if h.shared.serves(&id) {
        response::json_ok(&model_object(&h, &id))
    } else {
        ApiError::model_not_found(&id).into_response()
    }
}

/// The request's tenant, when API keys are on (set by [`require_key`]).
type TenantOf = Option<axum::Extension<Tenant>>;

async fn completions(State(h): HttpState, tenant: TenantOf, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    endpoint(&h, Endpoint::Generate(Kind::Completion), tenant, &headers, body).await
}

async fn chat(State(h): HttpState, tenant: TenantOf, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    endpoint(&h, Endpoint::Generate(Kind::Chat), tenant, &headers, body).await
}

async fn responses_route(State(h): HttpState, tenant: TenantOf, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    endpoint(&h, Endpoint::Responses, tenant, &headers, body).await
}

/// The endpoints that generate.
enum Endpoint {
    Generate(Kind),
    Responses,
}

/// `headers`: the client's `traceparent`, when tracing is on ([`ferry_proto::trace`]).
async fn endpoint(h: &Http, which: Endpoint, tenant: TenantOf, headers: &HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let tenant = tenant.map(|t| t.0);
    let parent = ferry_proto::trace::Parent::from_headers(headers);
    let r = match (body, which) {
        (Err(e), _) => Err(rejected(e)),
        (Ok(b), Endpoint::Generate(kind)) => generate::run(&h.shared, kind, tenant.as_ref(), parent, &b).await,
        (Ok(b), Endpoint::Responses) => responses::run(&h.shared, tenant.as_ref(), parent, &b).await,
    };
    r.unwrap_or_else(IntoResponse::into_response)
}

