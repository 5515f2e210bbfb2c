//! Tool calls in generated text: pure, no I/O. A [`Scanner`] takes the text as it arrives (all at
//! once for a whole answer, delta by delta for a stream) and gives back [`Piece`]s: content, and
//! complete calls. Both answers run the same scanner, so a stream's deltas add up to the whole
//! answer's message.
//!
//! The format is the one the model's chat template teaches ([`Format::detect`]):
//! - [`Format::Hermes`]: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per
//!   call, the JSON usually on its own line (Hermes 2/3, Qwen2.5, Qwen3 and templates written after
//!   them; vLLM's `hermes` parser).
//!
//! Rules, the same for both answers:
//! - text that may be the start of a tag is held back until it is known not to be;
//! - a block whose body is not a JSON object with a string `name` is content, tags and all;
//! - whitespace just before a call, between calls and at the end is dropped when a call was made
//!   (content is what the model said besides its calls); without calls, the text is unchanged;
//! - a block still open at the end is a call if its body is a complete one, else content;
//! - past `max_calls` (`parallel_tool_calls: false` allows one), further calls are dropped.

use serde::Deserialize;
use serde_json::value::RawValue;

/// How a model writes its tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`
    Hermes,
}

impl Format {
    /// The format a chat template teaches, by the tags it writes; `None` for one Ferry does not
    /// know.
    pub fn detect(template: &str) -> Option<Format> {
        template.contains("<tool_call>").then_some(Format::Hermes)
    }

    /// The name `--tool-call-parser` and the docs use (vLLM's).
    pub fn name(self) -> &'static str {
        match self {
            Format::Hermes => "hermes",
        }
    }

    /// The tags around one call.
    pub fn tags(self) -> (&'static str, &'static str) {
        match self {
            Format::Hermes => ("<tool_call>", "</tool_call>"),
        }
    }

    /// How a call is written between the tags, as a forced call is generated: the text before
    /// the arguments (after the name) and after them. The name goes in as a JSON string.
    pub fn call_text(self, name: &str) -> (String, &'static str) {
        let name = serde_json::Value::from(name).to_string();
        match self {
            Format::Hermes => (format!("<tool_call>\n{{\"name\": {name}, \"arguments\": "), "}\n</tool_call>"),
        }
    }

    /// What separates two calls a forced answer makes.
    pub fn separator(self) -> &'static str {
        match self {
            Format::Hermes => "\n",
        }
    }
}

/// One complete call: the function's name and its arguments as JSON text (as the model wrote
/// them; OpenAI's `function.arguments` is a string).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    pub name: String,
    pub arguments: String,
}

/// What the scanner gives back, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Call(Call),
}

/// The body of a block: `name`, and `arguments` (or `parameters`, as Llama-style models write).
#[derive(Deserialize)]
struct Body<'a> {
    name: String,
    #[serde(borrow, alias = "parameters")]
    arguments: Option<&'a RawValue>,
}

/// A block's body as a call, if it is one.
pub fn call_of(body: &str) -> Option<Call> {
    let b: Body = serde_json::from_str(body.trim()).ok()?;
    let arguments = match b.arguments.map(RawValue::get) {
        None | Some("null") => "{}".to_owned(),
        // Arguments written as a JSON string of JSON: the string's content.
        Some(raw) if raw.starts_with('"') => {
            let inner: String = serde_json::from_str(raw).ok()?;
            serde_json::from_str::<&RawValue>(&inner).ok()?;
            inner
        }
        Some(raw) => raw.to_owned(),
    };
    Some(Call { name: b.name, arguments })
}

/// Tool calls and content out of text that arrives in pieces (see the module doc).
#[derive(Clone, Debug)]
pub struct Scanner {
    format: Format,
    max_calls: Option<usize>,
    /// Text not yet given out: a possible tag start, or an open block's body.
    buf: String,
    inside: bool,
    /// Whitespace held back after the last content given out.
    ws: String,
    calls: usize,
}

impl Scanner {
    pub fn new(format: Format, max_calls: Option<usize>) -> Scanner {
        Scanner { format, max_calls, buf: String::new(), inside: false, ws: String::new(), calls: 0 }
    }

    /// Calls made so far (dropped ones not counted).
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// The pieces `text` completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let (open, close) = self.format.tags();
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.inside {
                let Some(end) = self.buf.find(close) else { break };
                let body: String = self.buf.drain(..end + close.len()).collect();
                self.inside = false;
                self.block(&body[..end], Some(close), &mut out);
            } else if let Some(start) = self.buf.find(open) {
                let before: String = self.buf.drain(..start + open.len()).collect();
                self.text(&before[..start], &mut out);
                self.inside = true;
            } else {
                let keep = partial_tag_len(&self.buf, open);
                let give: String = self.buf.drain(..self.buf.len() - keep).collect();
                self.text(&give, &mut out);
                break;
            }
        }
        out
    }

    /// The pieces left at the end of the text.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        if self.inside {
            self.inside = false;
            self.block(&rest, None, &mut out);
        } else {
            self.text(&rest, &mut out);
        }
        if self.calls == 0 && !self.ws.is_empty() {
            out.push(Piece::Text(std::mem::take(&mut self.ws)));
        }
        self.ws.clear();
        out
    }

    /// A block's body (`close`: the tag that ended it, none at the end of the text).
    fn block(&mut self, body: &str, close: Option<&str>, out: &mut Vec<Piece>) {
        match call_of(body) {
            Some(call) => {
                self.ws.clear();
                if self.max_calls.is_none_or(|m| self.calls < m) {
                    self.calls += 1;
                    out.push(Piece::Call(call));
                }
            }
            None => {
                let (open, _) = self.format.tags();
                self.text(&format!("{open}{body}{}", close.unwrap_or("")), out);
            }
        }
    }

    /// Content, with its trailing whitespace held back (see the module doc).
    fn text(&mut self, text: &str, out: &mut Vec<Piece>) {
        if text.is_empty() {
            return;
        }
        let kept = text.trim_end();
        if kept.is_empty() {
            self.ws.push_str(text);
            return;
        }
        let mut t = std::mem::take(&mut self.ws);
        t.push_str(kept);
        self.ws.push_str(&text[kept.len()..]);
        match out.last_mut() {
            Some(Piece::Text(prev)) => prev.push_str(&t),
            _ => out.push(Piece::Text(t)),
        }
    }
}

/// How many bytes at the end of `buf` may begin `tag` (a proper prefix of it).
fn partial_tag_len(buf: &str, tag: &str) -> usize {
    (1..tag.len().min(buf.len() + 1))
        .rev()
        .find(|&k| buf.is_char_boundary(buf.len() - k) && tag.starts_with(&buf[buf.len() - k..]))
        .unwrap_or(0)
}

#[cfg(test)]
#[path = "parse_tests.rs"]
mod tests;
