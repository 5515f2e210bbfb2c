//! OpenAI's Responses API, `POST /v1/responses`, stateless: a request carries its whole
//! conversation (`instructions` and `input`), nothing is stored (`store: true`,
//! `previous_response_id` and `conversation` are refused), and it runs as the chat request it
//! maps to ([`parse`], [`input`]): the chat path renders the prompt with the model's template and
//! tools, sets the grammar of `text.format` or a forcing `tool_choice`, and scans the answer for
//! calls ([`super::chat`]). Its answer becomes a `response` object, or that object's events
//! ([`events`]). Modelled on OpenAI's API reference for Responses (the request body, the output
//! items, the streaming events); vLLM and SGLang serve it the same way, over their chat path.

pub mod events;
pub mod input;
pub mod parse;

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use ferry_proto::v1::{self, generate_response::Event};
use tokio::sync::mpsc::Receiver;
use tokio_stream::StreamExt;

use super::{chat, generate, response};
use super::error::ApiError;
use crate::auth::Tenant;
use std::time::Instant;
use crate::state::Shared;
use crate::tools::calls::{Calls, Said};
use events::{Events, Head};

/// Serves one `POST /v1/responses` body.
pub async fn run(shared: &Arc<Shared>, tenant: Option<&Tenant>, parent: ferry_proto::trace::Parent, body: &[u8]) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let asked = parse::parse(body)?;
    let mut parsed = asked.chat;
    if !shared.serves(&parsed.model) {
        return Err(ApiError::model_not_found(&parsed.model));
    }
    let calls = chat::prepare(shared, &mut parsed).map_err(parse::rename)?;
    let field = parsed.structured_field;
    let started = chat::start(shared, &parsed, arrived, tenant, parent).await.map_err(|e| match (&e, field) {
        // A grammar that does not compile is named by the field it came in.
        (crate::RouterError::InvalidGrammar(g), Some(field)) => parse::rename(ApiError::invalid(format!("`{field}`: {g}"), Some(field))),
        _ => ApiError::from(e),
    })?;
    if !parsed.tags.is_empty() {
        tracing::info!(request_id = %started.request_id, tags = ?parsed.tags, "request tags");
    }
    let head = Head { id: format!("resp_{}", started.request_id), created_at: response::unix_now(), model: parsed.model, echo: asked.echo };
    let mut reply = Reply { events: Events::new(head), calls };
    let mut rx = started.events;
    if !parsed.stream {
        let whole = generate::collect(&mut rx, 1).await?;
        let a = whole.first().ok_or_else(|| ApiError::server("the request ended without an answer"))?;
        reply.text(&a.text);
        reply.finish(&a.fin);
        return Ok(response::json_ok(&reply.events.response()));
    }
    // Wait for the first event before answering 200, so that a request failing before its first
    // token still gets its own HTTP status.
    let first = match rx.recv().await {
        Some(Ok(m)) => m,
        Some(Err(s)) => return Err(ApiError::from_status(&s)),
        None => return Err(ApiError::server("the request ended without an answer")),
    };
    let head = wire(reply.events.start());
    let state = Streaming { reply, rx, first: Some(first), ended: false };
    let body = tokio_stream::once(head)
        .chain(futures_util::stream::unfold(state, Streaming::next))
        .filter(|b| !b.is_empty())
        .map(|s| Ok::<_, Infallible>(Bytes::from(s)));
    Ok(([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], Body::from_stream(body)).into_response())
}

/// A streamed response after its first events: the request's events in, SSE text out, until
/// the response ends (its final message, an error, or the request's events ending without
/// either, which fails it).
struct Streaming {
    reply: Reply,
    rx: Receiver<Result<v1::GenerateResponse, tonic::Status>>,
    first: Option<v1::GenerateResponse>,
    ended: bool,
}

impl Streaming {
    async fn next(mut self) -> Option<(String, Streaming)> {
        if self.ended {
            return None;
        }
        let ev = match self.first.take() {
            Some(m) => Some(Ok(m)),
            None => self.rx.recv().await,
        };
        let out = match ev {
            Some(ev) => {
                let (out, end) = self.reply.event(ev);
                self.ended = end;
                out
            }
            None => {
                self.ended = true;
                wire(self.reply.events.fail(&ApiError::server("the request ended without a final message")))
            }
        };
        Some((out, self))
    }
}

fn wire(events: Vec<serde_json::Value>) -> String {
    events.iter().map(events::sse).collect()
}

/// One response being answered: its events, and the scanner of its tool calls (with active
/// tools).
struct Reply {
    events: Events,
    calls: Option<Calls>,
}

impl Reply {
    /// The next of the answer's text.
    fn text(&mut self, t: &str) -> Vec<serde_json::Value> {
        let said = match &mut self.calls {
            Some(c) => c.push(t),
            None => vec![Said::Text(t.to_owned())],
        };
        said.into_iter().flat_map(|s| self.events.said(s)).collect()
    }

    /// What the scanner held back, then the end.
    fn finish(&mut self, fin: &v1::GenerateFinal) -> Vec<serde_json::Value> {
        let said = self.calls.as_mut().map(Calls::finish).unwrap_or_default();
        let mut out: Vec<serde_json::Value> = said.into_iter().flat_map(|s| self.events.said(s)).collect();
        out.extend(self.events.finish(fin));
        out
    }

    /// The SSE text of one event of the request, and whether it ended the response.
    fn event(&mut self, ev: Result<v1::GenerateResponse, tonic::Status>) -> (String, bool) {
        match ev {
            Ok(v1::GenerateResponse { event: Some(Event::Delta(d)), .. }) => (wire(self.text(&d.text)), false),
            Ok(v1::GenerateResponse { event: Some(Event::Final(f)), .. }) => (wire(self.finish(&f)), true),
            Ok(_) => (String::new(), false),
            Err(s) => (wire(self.events.fail(&ApiError::from_status(&s))), true),
        }
    }
}
