//! The Llama 3 JSON answer ([`Format::Llama3Json`], vLLM's `llama3_json`), read as it arrives:
//! `{"name": "f", "parameters": {...}}` (or `"arguments"`), optionally after `<|python_tag|>`,
//! several separated by `;`. Rules:
//! - an answer that does not start (after whitespace and the tag) with `{` is content as written;
//! - an object that is not a call is content, with what came before it (the whitespace and tag,
//!   or the `;` after the previous call) and everything after it;
//! - after a call, text other than `;` and another object is content; a `;` with nothing after
//!   it at the end is dropped.
//!
//! [`Format::Llama3Json`]: super::format::Format::Llama3Json

use super::read::Steps;
use super::object::{CallObject, End, Piece};

const TAG: &str = "<|python_tag|>";

/// A Llama 3 JSON answer being read.
#[derive(Clone, Debug)]
pub struct Reader(State);

#[derive(Clone, Debug)]
enum State {
    /// Before the first object: whitespace and the tag.
    Lead(String),
    /// A call's object, and the text before it (content if it is not a call).
    Object(String, CallObject),
    /// After a call: whitespace and a `;`, before the next object.
    Between(String),
    /// Content.
    Plain,
}

impl Default for Reader {
    fn default() -> Reader {
        Reader(State::Lead(String::new()))
    }
}

impl Steps for Reader {
    fn step(&mut self, text: String, out: &mut Vec<Piece>) -> String {
        let first = matches!(self.0, State::Lead(_));
        match &mut self.0 {
            State::Lead(buf) | State::Between(buf) => {
                buf.push_str(&text);
                match before_object(buf, first) {
                    Before::Wait => {}
                    Before::Object(at) => {
                        let object = buf.split_off(at);
                        self.0 = State::Object(std::mem::take(buf), CallObject::default());
                        return object;
                    }
                    Before::Content => {
                        out.push(Piece::Text(std::mem::take(buf)));
                        self.0 = State::Plain;
                    }
                }
                String::new()
            }
            State::Object(lead, obj) => match obj.feed(&text, out) {
                None => String::new(),
                Some((n, End::Call)) => {
                    self.0 = State::Between(String::new());
                    text[n..].to_owned()
                }
                Some((n, End::NotACall(body))) => {
                    out.push(Piece::Text(format!("{lead}{body}{}", &text[n..])));
                    self.0 = State::Plain;
                    String::new()
                }
            },
            State::Plain => {
                out.push(Piece::Text(text));
                String::new()
            }
        }
    }

    /// The end of the answer.
    fn end(&mut self, out: &mut Vec<Piece>) {
        match std::mem::replace(&mut self.0, State::Plain) {
            State::Lead(buf) if !buf.is_empty() => out.push(Piece::Text(buf)),
            State::Object(lead, mut obj) => {
                let mut pieces = Vec::new();
                match obj.finish(&mut pieces) {
                    End::Call => out.extend(pieces),
                    End::NotACall(body) => out.push(Piece::Text(lead + &body)),
                }
            }
            State::Lead(_) | State::Between(_) | State::Plain => {}
        }
    }
}

enum Before {
    /// Not yet known.
    Wait,
    /// An object starts at this byte.
    Object(usize),
    Content,
}

/// What the text before an object is: whitespace and the tag before the first (`first`), else
/// whitespace, `;` and whitespace.
fn before_object(buf: &str, first: bool) -> Before {
    let t = buf.trim_start();
    if t.is_empty() {
        return Before::Wait;
    }
    let after = match first {
        true if t.len() < TAG.len() && TAG.starts_with(t) => return Before::Wait,
        true => t.strip_prefix(TAG).unwrap_or(t),
        false => match t.strip_prefix(';') {
            Some(after) => after,
            None => return Before::Content,
        },
    };
    let u = after.trim_start();
    match u.chars().next() {
        None => Before::Wait,
        Some('{') => Before::Object(buf.len() - u.len()),
        Some(_) => Before::Content,
    }
}
