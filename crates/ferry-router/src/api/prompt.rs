//! A chat's prompt with its tools, for every client API (HTTP chat completions and responses,
//! gRPC `Generate`): the conversation rendered with the model's chat template into token ids;
//! with active tools, the tool-call format chosen ([`format_for`]), the tools given to the
//! template when it takes them in that format or written into the prompt by Ferry
//! ([`tools::generic`]), the grammar that holds the answer to what `tool_choice` allows, and the
//! scanner its calls are read with.

use ferry_tokenizer::ChatMessage;

use ferry_tokenizer::ModelText;

use crate::state::Shared;
use crate::tools::calls::Calls;
use crate::tools::format::Format;
use crate::tools::{self, Asked};
use crate::RouterError;

/// A prompt given as text, as token ids (the model's tokenizer, special tokens as it adds them).
pub fn text_ids(text: &ModelText, prompt: &str) -> Result<Vec<u32>, RouterError> {
    if prompt.is_empty() {
        return Err(RouterError::InvalidRequest("the prompt is empty".into()));
    }
    text.encode_prompt(prompt).map_err(RouterError::Tokenize)
}

/// A prompt given as token ids, each checked against the vocabulary.
pub fn checked_ids(text: &ModelText, ids: &[u32]) -> Result<Vec<u32>, RouterError> {
    let vocab = text.tokenizer.vocab_size();
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(RouterError::InvalidRequest(format!("token id {bad} is outside the vocabulary (size {vocab})")));
    }
    Ok(ids.to_vec())
}

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
        return Ok(ChatPrompt { ids: chat_ids(text, messages, None)?, grammar: None, calls: None });
    };
    let format = format_for(shared);
    let grammar = tools::grammar::lark(format, asked);
    let calls = Some(Calls::new(format, asked.max_calls()));
    if !format.in_template() {
        let ids = chat_ids(text, &tools::generic::messages(messages, asked), None)?;
        return Ok(ChatPrompt { ids, grammar, calls });
    }
    match chat_ids(text, messages, Some(&asked.offered)) {
        Ok(ids) => Ok(ChatPrompt { ids, grammar, calls }),
        // The conversation renders without the tools: it is the tools the template cannot take
        // (a tool without a `description`, say, where the template concatenates it).
        Err(RouterError::InvalidRequest(why)) if chat_ids(text, messages, None).is_ok() => Err(PromptError::Tools(why)),
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

/// A conversation rendered with the model's chat template, offering `tools` when given; with
/// `add_generation_prompt`, it ends with the assistant's header.
pub fn render_chat(
    text: &ModelText,
    messages: &[ChatMessage],
    tools: Option<&[serde_json::Value]>,
    add_generation_prompt: bool,
) -> Result<String, RouterError> {
    let tpl = text.chat_template.as_ref().ok_or_else(|| {
        RouterError::InvalidRequest(format!("model {} has no chat template", text.name))
    })?;
    tpl.render_with_tools(messages, tools, add_generation_prompt)
        .map_err(|e| RouterError::InvalidRequest(format!("chat template: {e}")))
}

/// A chat's prompt ids: the conversation rendered (as [`render_chat`], ending with the
/// assistant's header) and encoded without added special tokens (the template writes them
/// itself), what clients wrote tokenized as plain text ([`ferry_tokenizer::ChatTemplate::encode`]:
/// a `<|im_end|>` inside a message is characters, not the special token).
pub fn chat_ids(
    text: &ModelText,
    messages: &[ChatMessage],
    tools: Option<&[serde_json::Value]>,
) -> Result<Vec<u32>, RouterError> {
    encode_chat(text, messages, tools, true, false)
}

/// [`chat_ids`] with the choices `/tokenize` offers.
pub fn encode_chat(
    text: &ModelText,
    messages: &[ChatMessage],
    tools: Option<&[serde_json::Value]>,
    add_generation_prompt: bool,
    add_special_tokens: bool,
) -> Result<Vec<u32>, RouterError> {
    let tpl = text.chat_template.as_ref().ok_or_else(|| {
        RouterError::InvalidRequest(format!("model {} has no chat template", text.name))
    })?;
    tpl.encode(&text.tokenizer, messages, tools, add_generation_prompt, add_special_tokens)
        .map_err(|e| match e {
            e @ ferry_tokenizer::TokenizerError::TemplateRender(_) => RouterError::InvalidRequest(format!("chat template: {e}")),
            e => RouterError::Tokenize(e),
        })
}
