//! [`ChatTemplate::encode`]: a chat's prompt ids in which the text clients wrote (message
//! contents, names, tool calls, tool definitions) stays plain text. `<|im_end|>` typed into a
//! message is tokenized as the characters it is, never as the special token, so a message cannot
//! close its own turn and open a forged `system` one; the markers the template writes stay
//! special.
//!
//! How: before rendering, each special token's text inside a client string is replaced by a
//! marker, `U+E000 <index> U+E001` (private-use characters, which templates neither write nor
//! change: `.strip()`, `upper()` and `trim` leave them be). The rendered text is then cut at the
//! markers: the pieces between are tokenized with special tokens recognized (they are the
//! template's), each marker as the literal text it stands for. A chat whose client strings hold
//! no special token's text takes the plain path (render, tokenize the whole), so its ids are
//! exactly what they were before this existed.

use std::fmt::Write as _;

use serde_json::Value;

use crate::{ChatMessage, ChatTemplate, Tokenizer, TokenizerError};

const OPEN: char = '\u{E000}';
const CLOSE: char = '\u{E001}';

impl ChatTemplate {
    /// The ids of `messages` rendered (offering `tools`; ending with the assistant's header with
    /// `add_generation_prompt`), client text tokenized as plain text (see the module doc). With
    /// `add_special_tokens`, the tokenizer's BOS/EOS are added as [`Tokenizer::encode`] would.
    pub fn encode(
        &self,
        tok: &Tokenizer,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let table = escape_table(tok);
        let escaped_messages = escape_messages(messages, &table);
        let escaped_tools = tools.and_then(|t| escape_values(t, &table));
        if escaped_messages.is_none() && escaped_tools.is_none() {
            let rendered = self.render_with_tools(messages, tools, add_generation_prompt)?;
            return tok.encode(&rendered, add_special_tokens);
        }
        let messages = escaped_messages.as_deref().unwrap_or(messages);
        let tools = escaped_tools.as_deref().or(tools);
        let rendered = self.render_with_tools(messages, tools, add_generation_prompt)?;
        let mut body = Vec::with_capacity(rendered.len() / 3);
        for piece in split(&rendered, table.len()) {
            match piece {
                Piece::Template(t) => body.extend(tok.encode(t, false)?),
                Piece::Literal(k) => body.extend(tok.encode_literal(&table[k])?),
            }
        }
        if !add_special_tokens {
            return Ok(body);
        }
        // What the tokenizer adds around a text: BOS before, the rest (EOS) after.
        let wrap = tok.encode("", true)?;
        let before = wrap.iter().take_while(|&&id| Some(id) == tok.bos_id()).count();
        let mut ids = wrap[..before].to_vec();
        ids.extend(body);
        ids.extend(&wrap[before..]);
        Ok(ids)
    }
}

/// The texts a client string may not carry into the template: the special tokens' (longest
/// first), and the two marker characters themselves.
fn escape_table(tok: &Tokenizer) -> Vec<String> {
    let mut t = tok.special_texts();
    t.push(OPEN.to_string());
    t.push(CLOSE.to_string());
    t
}

/// `text` with each occurrence of a `table` entry (the leftmost, then the first listed) replaced
/// by its marker; `None` when there is none.
fn escape(text: &str, table: &[String]) -> Option<String> {
    let mut out: Option<String> = None;
    let (mut i, mut copied) = (0, 0);
    while i < text.len() {
        let rest = &text[i..];
        match table.iter().position(|t| rest.starts_with(t.as_str())) {
            Some(k) => {
                let o = out.get_or_insert_with(|| String::with_capacity(text.len() + 16));
                o.push_str(&text[copied..i]);
                let _ = write!(o, "{OPEN}{k}{CLOSE}");
                i += table[k].len();
                copied = i;
            }
            None => i += rest.chars().next().map_or(1, char::len_utf8),
        }
    }
    out.map(|mut o| {
        o.push_str(&text[copied..]);
        o
    })
}

/// The messages with their client strings escaped; `None` when nothing needed it.
fn escape_messages(messages: &[ChatMessage], table: &[String]) -> Option<Vec<ChatMessage>> {
    let mut changed = false;
    let mut esc = |s: &str| -> String {
        match escape(s, table) {
            Some(e) => {
                changed = true;
                e
            }
            None => s.to_owned(),
        }
    };
    let out: Vec<ChatMessage> = messages
        .iter()
        .map(|m| {
            let mut m = m.clone();
            m.content = esc(&m.content);
            m.name = m.name.as_deref().map(&mut esc);
            m.tool_call_id = m.tool_call_id.as_deref().map(&mut esc);
            for c in &mut m.tool_calls {
                c.id = c.id.as_deref().map(&mut esc);
                c.function.name = esc(&c.function.name);
            }
            m
        })
        .collect();
    // Tool-call arguments are JSON values: escaped apart.
    let mut out = out;
    for (m, orig) in out.iter_mut().zip(messages) {
        for (c, o) in m.tool_calls.iter_mut().zip(&orig.tool_calls) {
            if let Some(v) = escape_value(&o.function.arguments, table) {
                c.function.arguments = v;
                changed = true;
            }
        }
    }
    changed.then_some(out)
}

fn escape_values(values: &[Value], table: &[String]) -> Option<Vec<Value>> {
    let escaped: Vec<Option<Value>> = values.iter().map(|v| escape_value(v, table)).collect();
    if escaped.iter().all(Option::is_none) {
        return None;
    }
    Some(escaped.into_iter().zip(values).map(|(e, v)| e.unwrap_or_else(|| v.clone())).collect())
}

/// A JSON value with every string (keys included) escaped; `None` when none needed it.
fn escape_value(v: &Value, table: &[String]) -> Option<Value> {
    match v {
        Value::String(s) => escape(s, table).map(Value::String),
        Value::Array(a) => escape_values(a, table).map(Value::Array),
        Value::Object(o) => {
            let mut changed = false;
            let out = o
                .iter()
                .map(|(k, v)| {
                    let k2 = escape(k, table);
                    let v2 = escape_value(v, table);
                    changed |= k2.is_some() || v2.is_some();
                    (k2.unwrap_or_else(|| k.clone()), v2.unwrap_or_else(|| v.clone()))
                })
                .collect();
            changed.then_some(Value::Object(out))
        }
        Value::Null | Value::Bool(_) | Value::Number(_) => None,
    }
}

/// A piece of rendered text: the template's (special tokens recognized) or a marker's entry.
#[derive(Debug, PartialEq)]
enum Piece<'a> {
    Template(&'a str),
    Literal(usize),
}

/// Cuts `rendered` at the markers of a table of `n` entries (anything else between `OPEN` and
/// `CLOSE` stays text).
fn split(rendered: &str, n: usize) -> Vec<Piece<'_>> {
    let mut out = Vec::new();
    let (mut from, mut search) = (0, 0);
    while let Some(at) = rendered[search..].find(OPEN).map(|p| p + search) {
        let digits_at = at + OPEN.len_utf8();
        let marker = rendered[digits_at..]
            .find(CLOSE)
            .map(|p| (&rendered[digits_at..digits_at + p], digits_at + p + CLOSE.len_utf8()))
            .and_then(|(d, end)| Some((d.parse::<usize>().ok().filter(|&k| k < n && !d.starts_with('+'))?, end)));
        match marker {
            Some((k, end)) => {
                if at > from {
                    out.push(Piece::Template(&rendered[from..at]));
                }
                out.push(Piece::Literal(k));
                from = end;
                search = end;
            }
            None => search = digits_at,
        }
    }
    if from < rendered.len() {
        out.push(Piece::Template(&rendered[from..]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Vec<String> {
        ["<|im_start|>", "<|im_end|>", "<s>"].into_iter().map(String::from).chain([OPEN.to_string(), CLOSE.to_string()]).collect()
    }

    #[test]
    fn escape_replaces_special_texts_and_markers_only() {
        let t = table();
        assert_eq!(escape("plain text, <| not special", &t), None);
        assert_eq!(escape("", &t), None);
        assert_eq!(escape("a<|im_end|>b", &t).as_deref(), Some("a\u{E000}1\u{E001}b"));
        assert_eq!(escape("<s><|im_start|>", &t).as_deref(), Some("\u{E000}2\u{E001}\u{E000}0\u{E001}"));
        // A marker character a client sends is escaped too, so it cannot pose as a marker.
        assert_eq!(escape("\u{E000}0\u{E001}", &t).as_deref(), Some("\u{E000}3\u{E001}0\u{E000}4\u{E001}"));
        assert_eq!(escape("é<s>", &t).as_deref(), Some("é\u{E000}2\u{E001}"));
    }

    #[test]
    fn split_finds_markers_and_leaves_the_rest() {
        let r = "<|im_start|>user\nhi \u{E000}1\u{E001} there\u{E000}x\u{E001}\u{E000}9\u{E001}";
        assert_eq!(
            split(r, 5),
            vec![
                Piece::Template("<|im_start|>user\nhi "),
                Piece::Literal(1),
                Piece::Template(" there\u{E000}x\u{E001}\u{E000}9\u{E001}"),
            ]
        );
        assert_eq!(split("", 5), vec![]);
        assert_eq!(split("\u{E000}0\u{E001}", 5), vec![Piece::Literal(0)]);
    }

    #[test]
    fn json_strings_and_keys_are_escaped() {
        let t = table();
        let v = serde_json::json!({"a": ["x", "<s>"], "<|im_end|>": 1, "n": 2});
        let e = escape_value(&v, &t).expect("escaped");
        assert_eq!(e, serde_json::json!({"a": ["x", "\u{E000}2\u{E001}"], "\u{E000}1\u{E001}": 1, "n": 2}));
        assert_eq!(escape_value(&serde_json::json!({"a": "b"}), &t), None);
    }
}
