//! A chat request's prompt and tool calls, between parsing ([`super::request`]) and the answer:
//! the conversation and its tools are rendered by [`prompt::chat`] (as the gRPC API's are) and
//! sent to the workers as token ids, with the grammar of a constraining `tool_choice`; what comes
//! back is scanned for calls by the [`Calls`] it gives.

use ferry_proto::v1::{self, generate_request::Input, structured_output};

use super::error::ApiError;
use super::request::Parsed;
use crate::api::prompt::{self, PromptError};
use crate::state::Shared;
use crate::tools::calls::Calls;

/// Renders `parsed`'s conversation into `parsed.request.input`; with active tools, checks that the
/// model can take them, sets a forcing choice's grammar, and gives back the scanner for the
/// answer (`None`: the answer is plain text).
pub fn prepare(shared: &Shared, parsed: &mut Parsed) -> Result<Option<Calls>, ApiError> {
    let rendered = prompt::chat(shared, &parsed.messages, parsed.tools.as_ref()).map_err(|e| match e {
        e @ PromptError::Tools(_) => ApiError::invalid(e.to_string(), Some("tools")),
        PromptError::Other(e) => ApiError::from(e),
    })?;
    if let Some(lark) = rendered.grammar {
        let sampling = parsed.request.sampling.get_or_insert_with(Default::default);
        sampling.structured = Some(v1::StructuredOutput { kind: Some(structured_output::Kind::Lark(lark)) });
        parsed.structured_field = Some("tools");
    }
    parsed.request.input = Some(Input::Tokens(v1::TokenInput { ids: rendered.ids }));
    Ok(rendered.calls)
}
