//! How a model writes its tool calls: the format its chat template teaches (found in the
//! template's text), or Ferry's generic format for a model whose template takes no tools.

use std::fmt;
use std::str::FromStr;

/// A tool-call format (the names are vLLM's `--tool-call-parser` names where vLLM has one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, one block per call, text
    /// around them (Hermes 2/3, Qwen2.5, Qwen3 and templates written after them).
    Hermes,
    /// Ferry's own, for any model (after llama.cpp's generic format): the whole answer is one
    /// JSON object, `{"response": "text"}` or `{"tool_calls": [{"name": "f", "arguments":
    /// {...}}, ...]}`, kept to that shape by a grammar; Ferry describes the tools in the prompt
    /// ([`super::generic`]).
    Generic,
}

impl Format {
    /// Every format, for help text and errors.
    pub const ALL: [Format; 2] = [Format::Hermes, Format::Generic];

    /// The format a chat template that takes tools teaches, by what it writes; `None` for one
    /// Ferry does not know (such a model gets [`Format::Generic`]).
    pub fn detect(template: &str) -> Option<Format> {
        template.contains("<tool_call>").then_some(Format::Hermes)
    }

    /// The name `--tool-call-parser` and the docs use.
    pub fn name(self) -> &'static str {
        match self {
            Format::Hermes => "hermes",
            Format::Generic => "generic",
        }
    }

    /// Whether the tools reach the model through its chat template (else Ferry writes them into
    /// the prompt).
    pub fn in_template(self) -> bool {
        match self {
            Format::Hermes => true,
            Format::Generic => false,
        }
    }

    /// How one call is written, as a forced call is generated: the text before the arguments
    /// (the name goes in as a JSON string) and after them.
    pub fn call_text(self, name: &str) -> (String, &'static str) {
        let name = serde_json::Value::from(name).to_string();
        match self {
            Format::Hermes => (format!("<tool_call>\n{{\"name\": {name}, \"arguments\": "), "}\n</tool_call>"),
            Format::Generic => (format!("{{\"name\": {name}, \"arguments\": "), "}"),
        }
    }

    /// The text around an answer's calls, and between two of them.
    pub fn list_text(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Format::Hermes => ("", "\n", ""),
            Format::Generic => ("{\"tool_calls\": [", ", ", "]}"),
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Format {
    type Err = String;

    fn from_str(s: &str) -> Result<Format, String> {
        Format::ALL.into_iter().find(|f| f.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Format::ALL.iter().map(|f| f.name()).collect();
            format!("unknown tool-call format {s:?} (one of {})", names.join(", "))
        })
    }
}
