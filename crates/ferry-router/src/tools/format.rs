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
    /// Llama 3.1/3.2 (and 4) JSON: the answer is a call object `{"name": "f", "parameters":
    /// {...}}` (or `"arguments"`), optionally after `<|python_tag|>`, several separated by `; `;
    /// an answer that does not start with `{` is content.
    Llama3Json,
    /// Mistral: `[TOOL_CALLS]` and a JSON array of call objects `[{"name": "f", "arguments":
    /// {...}}, ...]`, content before it.
    Mistral,
    /// Llama 3.2/4 pythonic: the whole answer is a Python list of calls with keyword arguments,
    /// `[get_weather(city="Paris"), now()]` ([`super::pythonic`]).
    Pythonic,
}

impl Format {
    /// Every format, for help text and errors.
    pub const ALL: [Format; 5] = [Format::Hermes, Format::Llama3Json, Format::Mistral, Format::Pythonic, Format::Generic];

    /// The format a chat template that takes tools teaches, by what it writes; `None` for one
    /// Ferry does not know (such a model gets [`Format::Generic`]).
    /// The phrases are those of vLLM's example templates (`examples/tool_chat_template_*.jinja`)
    /// and the models' own: Mistral's control tokens, Hermes' tag, the pythonic templates' "python
    /// list" instructions (checked before JSON: Llama 3.2's pythonic template also says "Given the
    /// following functions"), Llama 3.1's JSON instructions or its `<|python_tag|>`.
    pub fn detect(template: &str) -> Option<Format> {
        let has = |needles: &[&str]| needles.iter().any(|n| template.contains(n));
        if has(&["[TOOL_CALLS]", "[AVAILABLE_TOOLS]"]) {
            Some(Format::Mistral)
        } else if has(&["<tool_call>"]) {
            Some(Format::Hermes)
        } else if has(&["respond with a python list", "[func_name1(params_name1=params_value1"]) {
            Some(Format::Pythonic)
        } else if has(&["respond with a JSON for a function call", "respond with JSON for a function call", "<|python_tag|>"]) {
            Some(Format::Llama3Json)
        } else {
            None
        }
    }

    /// The name `--tool-call-parser` and the docs use.
    pub fn name(self) -> &'static str {
        match self {
            Format::Hermes => "hermes",
            Format::Generic => "generic",
            Format::Llama3Json => "llama3_json",
            Format::Mistral => "mistral",
            Format::Pythonic => "pythonic",
        }
    }

    /// Whether the tools reach the model through its chat template (else Ferry writes them into
    /// the prompt).
    pub fn in_template(self) -> bool {
        match self {
            Format::Hermes | Format::Llama3Json | Format::Mistral | Format::Pythonic => true,
            Format::Generic => false,
        }
    }

    /// How one call is written, as a forced call is generated: the text before the arguments
    /// (the name goes in as a JSON string) and after them. In the pythonic format the
    /// arguments between are keyword arguments, not JSON ([`super::grammar`]).
    pub fn call_text(self, name: &str) -> (String, &'static str) {
        let quoted = serde_json::Value::from(name).to_string();
        match self {
            Format::Hermes => (format!("<tool_call>\n{{\"name\": {quoted}, \"arguments\": "), "}\n</tool_call>"),
            Format::Generic | Format::Mistral => (format!("{{\"name\": {quoted}, \"arguments\": "), "}"),
            Format::Llama3Json => (format!("{{\"name\": {quoted}, \"parameters\": "), "}"),
            Format::Pythonic => (format!("{name}("), ")"),
        }
    }

    /// The text around an answer's calls, and between two of them.
    pub fn list_text(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Format::Hermes => ("", "\n", ""),
            Format::Generic => ("{\"tool_calls\": [", ", ", "]}"),
            Format::Llama3Json => ("", "; ", ""),
            // The control token written as text: a tokenizer may make it one token or several,
            // and the scanner reads either (and the list without it).
            Format::Mistral => ("[TOOL_CALLS][", ", ", "]"),
            Format::Pythonic => ("[", ", ", "]"),
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
