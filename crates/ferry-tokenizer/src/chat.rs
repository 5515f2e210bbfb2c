//! Chat templates: the Jinja templates Hugging Face ships in `tokenizer_config.json` (and llama.cpp
//! copies into `tokenizer.chat_template`), rendered with minijinja the way `transformers`'
//! `apply_chat_template` does: `trim_blocks` and `lstrip_blocks` on, Python string methods
//! (`.strip()`, `.startswith()`, …) through `minijinja_contrib::pycompat`, a `raise_exception`
//! function, and `messages`, `add_generation_prompt`, `bos_token`, `eos_token` and `tools` in the
//! context. Messages carry what tool-calling templates read: an assistant's `tool_calls` (with
//! `function.arguments` as an object, as HF templates expect), a tool result's `tool_call_id`, and
//! a `name`; fields a message lacks are left undefined, as they are for a Python dict.
//!
//! Whether a template takes tools is read from the template itself: it refers to a `tools`
//! variable it does not define ([`ChatTemplate::takes_tools`]).

use std::path::Path;

use minijinja::{Environment, ErrorKind, context};
use serde::{Deserialize, Serialize};

use crate::{Tokenizer, TokenizerError};

const NAME: &str = "chat";

/// Who speaks a turn: the roles the OpenAI API defines. `developer` (OpenAI's newer name for the
/// system message) is read as [`Role::System`]. Templates see the lowercase name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    #[serde(alias = "developer")]
    System,
    #[default]
    User,
    Assistant,
    Tool,
    /// The deprecated result of a `function_call` (OpenAI's `function` role, with a `name`).
    Function,
}

impl Role {
    /// The names [`Role::parse`] accepts, for error messages.
    pub const NAMES: &'static str = "system, developer, user, assistant, tool, function";

    /// A role's wire name (`developer` is `system`); `None` for any other string.
    pub fn parse(name: &str) -> Option<Role> {
        match name {
            "system" | "developer" => Some(Role::System),
            "user" => Some(Role::User),
            "assistant" => Some(Role::Assistant),
            "tool" => Some(Role::Tool),
            "function" => Some(Role::Function),
            _ => None,
        }
    }

    /// The name templates see.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
            Role::Function => "function",
        }
    }
}

/// One turn of a conversation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
    /// The calls an assistant's turn made (absent from the template's view when empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A tool result's answer to which call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The speaker's name, or for a tool result the function's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        ChatMessage {
            role,
            content: content.into(),
            ..ChatMessage::default()
        }
    }
}

/// One call in an assistant's turn, shaped as HF templates read it:
/// `{"id", "type": "function", "function": {"name", "arguments": {...}}}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

/// A called function: its name and its arguments (a JSON value, usually an object).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: serde_json::Value,
}

/// A compiled chat template with the special-token strings it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// The template's text (tool-call parsers are chosen by what it writes).
    source: String,
    takes_tools: bool,
}

fn read(path: &Path) -> Result<String, TokenizerError> {
    std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn raise_exception(message: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// Jinja2's `iterable` test, where `None` is not iterable (minijinja iterates it as empty):
/// `tools is iterable and tools | length > 0` must be false without tools.
fn is_iterable(v: minijinja::Value) -> bool {
    !v.is_none() && v.try_iter().is_ok()
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_test("iterable", is_iterable);
        env.add_template_owned(NAME, source.to_owned())
            .map_err(TokenizerError::TemplateSyntax)?;
        let takes_tools = env
            .get_template(NAME)
            .map_err(TokenizerError::TemplateSyntax)?
            .undeclared_variables(false)
            .contains("tools");
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            source: source.to_owned(),
            takes_tools,
        })
    }

    /// Reads `chat_template` from a Hugging Face `tokenizer_config.json` (a string, or a list of
    /// `{name, template}` from which `"default"` is taken), else a `chat_template.jinja` next to
    /// it. `Ok(None)` when the model has no template.
    pub fn from_tokenizer_config(path: &Path) -> Result<Option<Self>, TokenizerError> {
        let text = read(path)?;
        let invalid = |message: String| TokenizerError::Config {
            path: path.to_path_buf(),
            message,
        };
        let config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;

        let source = match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => {
                let sibling = path.with_file_name("chat_template.jinja");
                if !sibling.is_file() {
                    return Ok(None);
                }
                read(&sibling)?
            }
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .ok_or_else(|| invalid("chat_template list has no \"default\" template".into()))?
                .to_owned(),
            Some(other) => {
                return Err(invalid(format!(
                    "chat_template is neither a string nor a list: {other}"
                )));
            }
        };
        let token = |key: &str| -> Result<String, TokenizerError> {
            match config.get(key) {
                None | Some(serde_json::Value::Null) => Ok(String::new()),
                Some(serde_json::Value::String(s)) => Ok(s.clone()),
                Some(v) => v
                    .get("content")
                    .and_then(|c| c.as_str())
                    .map(str::to_owned)
                    .ok_or_else(|| {
                        invalid(format!(
                            "{key} is neither a string nor {{\"content\": ...}}"
                        ))
                    }),
            }
        };
        Self::new(&source, &token("bos_token")?, &token("eos_token")?).map(Some)
    }

    /// The template in `tokenizer.chat_template`, with BOS/EOS strings from `tok`.
    /// `Ok(None)` when the file has no template.
    pub fn from_gguf(
        gguf: &ferry_gguf::GgufFile,
        tok: &Tokenizer,
    ) -> Result<Option<Self>, TokenizerError> {
        const KEY: &str = "tokenizer.chat_template";
        if gguf.get(KEY).is_none() {
            return Ok(None);
        }
        let source = gguf.get_str(KEY)?;
        let name = |id: Option<u32>| id.and_then(|id| tok.id_to_token(id)).unwrap_or_default();
        Self::new(
            source,
            &name(tok.bos_id()),
            &name(tok.eos_ids().first().copied()),
        )
        .map(Some)
    }

    /// Renders a conversation; with `add_generation_prompt`, ends with the assistant's header.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// Renders a conversation offering `tools` (OpenAI's `[{"type": "function", "function":
    /// {name, description, parameters}}]`, passed as they are); `None` renders `tools` as none,
    /// as `transformers` does without tools.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let template = self
            .env
            .get_template(NAME)
            .map_err(TokenizerError::TemplateRender)?;
        template
            .render(context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(TokenizerError::TemplateRender)
    }

    /// Whether the template takes a `tools` list (it reads a `tools` variable it does not set).
    pub fn takes_tools(&self) -> bool {
        self.takes_tools
    }

    /// The template's Jinja text.
    pub fn source(&self) -> &str {
        &self.source
    }
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("takes_tools", &self.takes_tools)
            .finish_non_exhaustive()
    }
}
