//! A chat request's prompt and tool calls, between parsing ([`super::request`]) and the answer:
//! the conversation is rendered here with the model's chat template and sent to the workers as
//! token ids (the same ids the gRPC `Chat` input gets, through [`service::chat_ids`]). Active
//! tools go to the template when it takes them in a format Ferry reads; for any other model Ferry
//! writes them into the prompt itself ([`crate::tools::generic`]). The format's grammar holds the
//! answer to what `tool_choice` allows ([`crate::tools::grammar`]), and what comes back is
//! scanned for calls by a [`Calls`].

use ferry_proto::v1::{self, generate_request::Input, structured_output};

use super::error::ApiError;
use super::request::Parsed;
use crate::service::{self, Shared};
use crate::tools::calls::Calls;
use crate::tools::format::Format;
use crate::tools::{generic, grammar};
use crate::RouterError;

/// Renders `parsed`'s conversation into `parsed.request.input`; with active tools, checks that the
/// model can take them, sets a forcing choice's grammar, and gives back the scanner for the
/// answer (`None`: the answer is plain text).
pub fn prepare(shared: &Shared, parsed: &mut Parsed) -> Result<Option<Calls>, ApiError> {
    let text = &shared.text;
    let active = parsed.tools.as_ref().filter(|a| a.active());
    let mut calls = None;
    let mut messages = std::borrow::Cow::Borrowed(&parsed.messages);
    let mut offered = None;
    if let Some(asked) = active {
        let format = format_for(shared);
        if let Some(lark) = grammar::lark(format, asked) {
            let sampling = parsed.request.sampling.get_or_insert_with(Default::default);
            sampling.structured = Some(v1::StructuredOutput { kind: Some(structured_output::Kind::Lark(lark)) });
            parsed.structured_field = Some("tools");
        }
        match format.in_template() {
            true => offered = Some(asked.offered.as_slice()),
            false => messages = std::borrow::Cow::Owned(generic::messages(&parsed.messages, asked)),
        }
        calls = Some(Calls::new(format, asked.max_calls()));
    }
    let ids = match service::chat_ids(text, &messages, offered) {
        Ok(ids) => ids,
        // The conversation renders without the tools: it is the tools the template cannot take
        // (a tool without a `description`, say, where the template concatenates it).
        Err(RouterError::InvalidRequest(why)) if offered.is_some() && service::chat_ids(text, &messages, None).is_ok() => {
            return Err(ApiError::invalid(
                format!("the model's chat template cannot render these `tools` ({why}); give each function the fields its template uses, such as a `description`"),
                Some("tools"),
            ));
        }
        Err(e) => return Err(ApiError::from(e)),
    };
    parsed.request.input = Some(Input::Tokens(v1::TokenInput { ids }));
    Ok(calls)
}

/// The tool-call format for this router's model: the router's `--tool-call-parser`, else the one
/// its chat template teaches, else (a template that takes no tools, or writes calls in a format
/// Ferry does not know) the generic format.
pub fn format_for(shared: &Shared) -> Format {
    let template = shared.text.chat_template.as_ref().filter(|t| t.takes_tools());
    shared.cfg.tool_call_parser.or_else(|| template.and_then(|t| Format::detect(t.source()))).unwrap_or(Format::Generic)
}
