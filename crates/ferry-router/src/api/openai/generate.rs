//! A completion or chat request through the pipeline: parsed ([`super::request`]), its chat
//! rendered ([`super::chat`]), started on the pipeline, and its events turned into one JSON answer
//! or server-sent events ([`super::response`]), with tool calls scanned out of the text.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use ferry_proto::v1::{self, generate_response::Event};
use serde_json::Value;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

use crate::auth::Tenant;
use std::time::Instant;
use crate::state::Shared;
use super::error::ApiError;
use super::body::Kind;
use super::request;
use super::response::{self, Meta};
use super::{chat, logprobs_json};

/// One completion or chat request: parsed, started on the pipeline, and answered as one JSON
/// object or as server-sent events.
pub async fn run(shared: &Arc<Shared>, kind: Kind, tenant: Option<&Tenant>, parent: ferry_proto::trace::Parent, body: &[u8]) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let mut parsed = request::parse(kind, body)?;
    if !shared.serves(&parsed.model) {
        return Err(ApiError::model_not_found(&parsed.model));
    }
    let calls = match kind {
        Kind::Chat => chat::prepare(shared, &mut parsed)?,
        Kind::Completion => None,
    };
    let want = parsed.logprobs;
    let n = parsed.params.n.max(1);
    let echo = want.echo.then(|| logprobs_json::prompt_text(shared, parsed.input.as_ref()));
    let started = chat::start(shared, &parsed, arrived, tenant, parent).await.map_err(|e| match (&e, parsed.structured_field) {
        // A grammar that does not compile is named by the field it came in.
        (crate::RouterError::InvalidGrammar(g), Some(field)) => ApiError::invalid(format!("`{field}`: {g}"), Some(field)),
        _ => ApiError::from(e),
    })?;
    if !parsed.tags.is_empty() {
        // `user`, `metadata`, …: the client's words about the request, for the logs only.
        tracing::info!(request_id = %started.request_id, tags = ?parsed.tags, "request tags");
    }
    let render = logprobs_json::Render::new(shared.clone(), kind, want, started.prompt.first().copied());
    let mut renders = vec![render; n as usize];
    let mut meta = Meta::new(
        kind,
        &started.request_id,
        response::unix_now(),
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
        return Ok(response::json_ok(&v));
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
pub struct Answer {
    pub text: String,
    pub fin: v1::GenerateFinal,
    pub logprobs: logprobs_json::Collected,
}

/// The answers of a request's `n` choices, in order, or the error it ended with.
pub async fn collect(
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
    renders: Vec<logprobs_json::Render>,
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
        let (text, lp) = match logprobs_json::is_prompt_delta(&d) {
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
