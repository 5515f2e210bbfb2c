//! What a request asked of tools: the functions offered ([`Tool`]) and the `tool_choice`.

use serde_json::Value;

/// One offered function.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// Its `parameters` JSON schema (an object; `{}`-like when the client gave none).
    pub parameters: Value,
}

impl Tool {
    /// The tool as OpenAI's chat API writes it (what chat templates get as `tools`).
    pub fn openai(&self) -> Value {
        let mut f = serde_json::json!({"name": self.name, "parameters": self.parameters});
        if let Some(d) = &self.description {
            f["description"] = Value::from(d.as_str());
        }
        serde_json::json!({"type": "function", "function": f})
    }
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq)]
pub enum Choice {
    /// No tools offered, no calls scanned.
    None,
    /// Tools offered; the model may answer or call.
    Auto,
    /// The model must call at least one of the tools.
    Required,
    /// The model must call this function.
    Named(String),
}

/// A request's tools and what it asks of them.
#[derive(Clone, Debug, PartialEq)]
pub struct Asked {
    /// `tools` as the client sent them (what a chat template that takes tools gets).
    pub offered: Vec<Value>,
    pub tools: Vec<Tool>,
    pub choice: Choice,
    /// `parallel_tool_calls` (default true): false allows one call per answer.
    pub parallel: bool,
}

impl Asked {
    /// Whether tools are offered and the answer is scanned for calls.
    pub fn active(&self) -> bool {
        !self.tools.is_empty() && self.choice != Choice::None
    }

    /// Whether a grammar makes the model call (`required` or a named function).
    pub fn forces(&self) -> bool {
        matches!(self.choice, Choice::Required | Choice::Named(_))
    }

    /// The most calls an answer may make.
    pub fn max_calls(&self) -> Option<usize> {
        match (&self.choice, self.parallel) {
            (Choice::Named(_), _) | (_, false) => Some(1),
            _ => None,
        }
    }

    /// The functions the model may call: every offered one, or the named one.
    pub fn allowed(&self) -> Vec<&Tool> {
        match &self.choice {
            Choice::None => Vec::new(),
            Choice::Auto | Choice::Required => self.tools.iter().collect(),
            Choice::Named(name) => self.tools.iter().filter(|t| &t.name == name).collect(),
        }
    }
}
