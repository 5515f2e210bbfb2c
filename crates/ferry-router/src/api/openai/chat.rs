//! A chat request's prompt and tool calls, between parsing ([`super::request`]) and the answer:
//! the conversation and its tools are rendered by [`prompt::chat`] (as the gRPC API's are) and
//! sent to the workers as token ids, with the grammar of a constraining `tool_choice`; what comes
//! back is scanned for calls by the [`Calls`] it gives.

use ferry_core::sampling::OutputGrammar;
use ferry_proto::v1::{self, generate_request::Input};

use std::sync::Arc;
use std::time::Instant;

use super::error::ApiError;
use super::request::Parsed;
use crate::api::prompt::{self, PromptError};
use crate::RouterError;
use crate::auth::Tenant;
use crate::pipeline::{self, Intake, Started};
use crate::pipeline::start::{refused, request_id, request_span};
use crate::state::Shared;
use crate::tools::calls::Calls;

/// Renders `parsed`'s conversation into `parsed.input`; with active tools, checks that the
/// model can take them, sets a forcing choice's grammar, and gives back the scanner for the
/// answer (`None`: the answer is plain text).
pub fn prepare(shared: &Shared, parsed: &mut Parsed) -> Result<Option<Calls>, ApiError> {
    let rendered = prompt::chat(shared, &parsed.messages, parsed.tools.as_ref()).map_err(|e| match e {
        e @ PromptError::Tools(_) => ApiError::invalid(e.to_string(), Some("tools")),
        PromptError::Other(e) => ApiError::from(e),
    })?;
    if let Some(lark) = rendered.grammar {
        parsed.params.grammar = Some(OutputGrammar::Lark(lark));
        parsed.structured_field = Some("tools");
    }
    parsed.input = Some(Input::Tokens(v1::TokenInput { ids: rendered.ids }));
    Ok(rendered.calls)
}

/// Starts a parsed request on the pipeline: its prompt as token ids (a chat's rendered by
/// [`prepare`] first) and its sampling as parsed, converted and checked once; `parent`: the
/// client's span, when it sent one.
pub async fn start(shared: &Arc<Shared>, parsed: &Parsed, arrived: Instant, tenant: Option<&Tenant>, parent: ferry_proto::trace::Parent) -> Result<Started, RouterError> {
    let text = &shared.text;
    let prompt = match &parsed.input {
        Some(Input::Prompt(p)) => prompt::text_ids(text, p),
        Some(Input::Tokens(t)) => prompt::checked_ids(text, &t.ids),
        Some(Input::Chat(_)) | None => Err(RouterError::InvalidRequest("no prompt: a chat is rendered before it starts".into())),
    }
    .map_err(refused)?;
    let id = request_id("")?;
    let span = request_span(&id, &parent);
    let intake = Intake { request_id: id, prompt, params: parsed.params.clone(), cache_salt: parsed.cache_salt.clone(), arrived, span };
    pipeline::start(shared, intake, tenant).await
}
