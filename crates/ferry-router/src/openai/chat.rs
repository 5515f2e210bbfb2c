//! A chat request's prompt and tool calls, between parsing ([`super::request`]) and the answer:
//! the conversation is rendered here with the model's chat template, offering the request's
//! tools when they are active, and sent to the workers as token ids (the same ids the gRPC
//! `Chat` input gets, through [`service::chat_ids`]). Tools need a template that takes them and
//! a tool-call format Ferry parses; a forcing `tool_choice` sets the grammar
//! ([`super::tools::grammar`]). What comes back is scanned for calls by a [`Calls`].

use ferry_proto::v1::{self, generate_request::Input, structured_output};

use super::error::ApiError;
use super::request::Parsed;
use super::response::IdCall;
use super::tools::grammar;
use super::tools::parse::{Call, Format, Piece, Scanner};
use crate::service::{self, Shared};
use crate::RouterError;

/// Renders `parsed`'s conversation into `parsed.request.input`; with active tools, checks that the
/// model can take them, sets a forcing choice's grammar, and gives back the scanner for the
/// answer (`None`: the answer is plain text).
pub fn prepare(shared: &Shared, parsed: &mut Parsed) -> Result<Option<Calls>, ApiError> {
    let text = &shared.text;
    let active = parsed.tools.as_ref().filter(|a| a.active());
    let mut calls = None;
    if let Some(asked) = active {
        let no_support = |why: &str| {
            ApiError::invalid(
                format!("`tools`: the chat template of model `{}` has no tool support ({why}); send no `tools`, or `tool_choice: \"none\"`", text.name),
                Some("tools"),
            )
        };
        let tpl = match &text.chat_template {
            Some(t) if t.takes_tools() => t,
            Some(_) => return Err(no_support("it does not take `tools`")),
            None => return Err(no_support("the model has no chat template")),
        };
        let format = match shared.cfg.tool_call_parser {
            Some(f) => f,
            None => Format::detect(tpl.source()).ok_or_else(|| {
                no_support("it takes `tools`, but writes calls in no format Ferry parses; name one with the router's --tool-call-parser")
            })?,
        };
        if let Some(lark) = grammar::lark(format, asked) {
            let sampling = parsed.request.sampling.get_or_insert_with(Default::default);
            sampling.structured = Some(v1::StructuredOutput { kind: Some(structured_output::Kind::Lark(lark)) });
            parsed.structured_field = Some("tools");
        }
        calls = Some(Calls { scanner: Scanner::new(format, asked.max_calls()), made: Vec::new() });
    }
    let tools = active.map(|a| a.offered.as_slice());
    let ids = match service::chat_ids(text, &parsed.messages, tools) {
        Ok(ids) => ids,
        // The conversation renders without the tools: it is the tools the template cannot take
        // (a tool without a `description`, say, where the template concatenates it).
        Err(RouterError::InvalidRequest(why)) if tools.is_some() && service::chat_ids(text, &parsed.messages, None).is_ok() => {
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

/// The tool calls of one answer, found as its text arrives; each gets its `call_<random>` id.
/// A request for `n` choices scans each with its own clone.
#[derive(Clone, Debug)]
pub struct Calls {
    scanner: Scanner,
    made: Vec<IdCall>,
}

/// What the answer says next: content, or a call (with its index in the answer).
#[derive(Debug)]
pub enum Said {
    Text(String),
    Call(usize, IdCall),
}

impl Calls {
    /// What `text` (the next of the answer's text) completes.
    pub fn push(&mut self, text: &str) -> Vec<Said> {
        let pieces = self.scanner.push(text);
        self.said(pieces)
    }

    /// What is left at the end of the answer.
    pub fn finish(&mut self) -> Vec<Said> {
        let pieces = self.scanner.finish();
        self.said(pieces)
    }

    /// How many calls the answer made so far.
    pub fn count(&self) -> usize {
        self.made.len()
    }

    /// The whole answer's content and calls.
    pub fn whole(mut self, text: &str) -> (String, Vec<IdCall>) {
        let mut content = String::new();
        for s in self.push(text).into_iter().chain(self.finish()) {
            if let Said::Text(t) = s {
                content.push_str(&t);
            }
        }
        (content, self.made)
    }

    fn said(&mut self, pieces: Vec<Piece>) -> Vec<Said> {
        pieces
            .into_iter()
            .map(|p| match p {
                Piece::Text(t) => Said::Text(t),
                Piece::Call(call) => {
                    let c = id_call(call);
                    self.made.push(c.clone());
                    Said::Call(self.made.len() - 1, c)
                }
            })
            .collect()
    }
}

/// OpenAI's ids look like `call_` and 24 letters and digits.
fn id_call(call: Call) -> IdCall {
    const ALNUM: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let id: String = (0..24).map(|_| ALNUM[rand::random_range(0..ALNUM.len())] as char).collect();
    IdCall { id: format!("call_{id}"), call }
}
