//! A chat's prompt with its tools, for every client API (HTTP chat completions and responses,
//! gRPC `Generate`): the conversation rendered with the model's chat template into token ids;
//! with active tools, the tool-call format chosen ([`format_for`]), the tools given to the
//! template when it takes them in that format or written into the prompt by Ferry
//! ([`tools::generic`]), the grammar that holds the answer to what `tool_choice` allows, and the
//! scanner its calls are read with.

use ferry_tokenizer::ChatMessage;

use crate::service::{self, Shared};
use crate::tools::calls::Calls;
use crate::tools::format::Format;
use crate::tools::{self, Asked};
use crate::RouterError;

/// A rendered chat.
#[derive(Debug)]
pub struct ChatPrompt {
    pub ids: Vec<u32>,
    /// The Lark grammar of a tool choice that constrains the answer.
    pub grammar: Option<String>,
    /// The answer's tool-call scanner (with active tools).
    pub calls: Option<Calls>,
}

/// Why a chat could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// The template renders the conversation but not these tools.
    #[error("the model's chat template cannot render these `tools` ({0}); give each function the fields its template uses, such as a `description`")]
    Tools(String),
    #[error(transparent)]
    Other(#[from] RouterError),
}

/// Renders `messages` with `asked`'s tools (when active).
pub fn chat(shared: &Shared, messages: &[ChatMessage], asked: Option<&Asked>) -> Result<ChatPrompt, PromptError> {
    let text = &shared.text;
    let Some(asked) = asked.filter(|a| a.active()) else {
        return Ok(ChatPrompt { ids: service::chat_ids(text, messages, None)?, grammar: None, calls: None });
    };
    let format = format_for(shared);
    let grammar = tools::grammar::lark(format, asked);
    let calls = Some(Calls::new(format, asked.max_calls()));
    if !format.in_template() {
        let ids = service::chat_ids(text, &tools::generic::messages(messages, asked), None)?;
        return Ok(ChatPrompt { ids, grammar, calls });
    }
    match service::chat_ids(text, messages, Some(&asked.offered)) {
        Ok(ids) => Ok(ChatPrompt { ids, grammar, calls }),
        // The conversation renders without the tools: it is the tools the template cannot take
        // (a tool without a `description`, say, where the template concatenates it).
        Err(RouterError::InvalidRequest(why)) if service::chat_ids(text, messages, None).is_ok() => Err(PromptError::Tools(why)),
        Err(e) => Err(e.into()),
    }
}

/// The tool-call format for this router's model: the router's `--tool-call-parser`, else the one
/// its chat template teaches, else (a template that takes no tools, or writes calls in a format
/// Ferry does not know) the generic format.
pub fn format_for(shared: &Shared) -> Format {
    let template = shared.text.chat_template.as_ref().filter(|t| t.takes_tools());
    shared.cfg.tool_call_parser.or_else(|| template.and_then(|t| Format::detect(t.source()))).unwrap_or(Format::Generic)
}
