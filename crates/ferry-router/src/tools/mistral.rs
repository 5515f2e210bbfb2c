//! The Mistral answer ([`Format::Mistral`], vLLM's `mistral` with a JSON-list tokenizer), read
//! as it arrives: content, then `[TOOL_CALLS]` and a JSON array of call objects,
//! `[{"name": "f", "arguments": {...}}, ...]`. Rules:
//! - text before `[TOOL_CALLS]` is content (a possible start of the token is held back);
//! - the router's detokenizer may drop special tokens, `[TOOL_CALLS]` among them, so an answer
//!   that begins (after whitespace) with `[{"name"` is read as the call list too;
//! - a list whose element is not a call object is content from the token (or, after calls, from
//!   that element) on; after the list's `]`, text is content again;
//! - a list cut short keeps the calls that arrived (the last with the arguments that did).
//!
//! Mistral's newer tokenizers write `[TOOL_CALLS]name[ARGS]{...}` instead; that form is content
//! here.
//!
//! [`Format::Mistral`]: super::format::Format::Mistral

use super::read::Steps;
use super::object::{CallObject, Cursor, End, Piece, Step};
use super::read::partial_tag_len;

const TAG: &str = "[TOOL_CALLS]";

/// A Mistral answer being read.
#[derive(Clone, Debug)]
pub struct Reader(State);

/// `raw` in the list states: the list's text from the token on, while no call of the list has
/// opened (content if none does); `None` after.
#[derive(Clone, Debug)]
enum State {
    /// The answer's start: whitespace, and perhaps a bare list.
    Lead(String),
    /// Content, looking for the token.
    Text(String),
    /// After the token, before the list's `[`.
    Tag(String),
    /// In the list, between elements.
    List(Option<String>),
    /// An element of the list.
    Object(Option<String>, CallObject),
}

impl Default for Reader {
    fn default() -> Reader {
        Reader(State::Lead(String::new()))
    }
}

impl Steps for Reader {
    fn step(&mut self, text: String, out: &mut Vec<Piece>) -> String {
        match &mut self.0 {
            State::Lead(buf) => {
                buf.push_str(&text);
                let mut c = Cursor { s: buf, at: 0 };
                let bare = (|| {
                    c.lit("[")?;
                    c.lit("{")?;
                    c.lit("\"name\"")
                })();
                match bare {
                    Err(Step::More) => String::new(),
                    Ok(()) => {
                        let open = buf.find('[').unwrap_or(0);
                        let list = buf.split_off(open + 1);
                        buf.pop();
                        text_piece(std::mem::take(buf), out);
                        self.0 = State::List(Some("[".to_owned()));
                        list
                    }
                    Err(Step::No) => {
                        let all = std::mem::take(buf);
                        self.0 = State::Text(String::new());
                        all
                    }
                }
            }
            State::Text(buf) => {
                buf.push_str(&text);
                if let Some(start) = buf.find(TAG) {
                    let rest = buf.split_off(start + TAG.len());
                    buf.truncate(start);
                    text_piece(std::mem::take(buf), out);
                    self.0 = State::Tag(String::new());
                    return rest;
                }
                let keep = partial_tag_len(buf, TAG);
                let give: String = buf.drain(..buf.len() - keep).collect();
                text_piece(give, out);
                String::new()
            }
            State::Tag(buf) => {
                buf.push_str(&text);
                let t = buf.trim_start();
                match t.chars().next() {
                    None => String::new(),
                    Some('[') => {
                        let at = buf.len() - t.len() + 1;
                        let list = buf.split_off(at);
                        self.0 = State::List(Some(format!("{TAG}{buf}")));
                        list
                    }
                    Some(_) => {
                        let all = std::mem::take(buf);
                        text_piece(TAG.to_owned(), out);
                        self.0 = State::Text(String::new());
                        all
                    }
                }
            }
            State::List(raw) => {
                for (i, c) in text.char_indices() {
                    match c {
                        c if c.is_whitespace() || c == ',' => {
                            if let Some(r) = raw {
                                r.push(c);
                            }
                        }
                        '{' => {
                            self.0 = State::Object(raw.take(), CallObject::default());
                            return text[i..].to_owned();
                        }
                        ']' => {
                            self.0 = State::Text(String::new());
                            return text[i + 1..].to_owned();
                        }
                        _ => {
                            text_piece(raw.take().unwrap_or_default(), out);
                            self.0 = State::Text(String::new());
                            return text[i..].to_owned();
                        }
                    }
                }
                String::new()
            }
            State::Object(raw, obj) => match obj.feed(&text, out) {
                None => String::new(),
                Some((n, End::Call)) => {
                    self.0 = State::List(None);
                    text[n..].to_owned()
                }
                Some((n, End::NotACall(body))) => {
                    text_piece(raw.take().unwrap_or_default() + &body, out);
                    self.0 = State::Text(String::new());
                    text[n..].to_owned()
                }
            },
        }
    }

    /// The end of the answer.
    fn end(&mut self, out: &mut Vec<Piece>) {
        match std::mem::replace(&mut self.0, State::List(None)) {
            State::Lead(buf) | State::Text(buf) => text_piece(buf, out),
            State::Tag(buf) => text_piece(format!("{TAG}{buf}"), out),
            State::List(raw) => text_piece(raw.unwrap_or_default(), out),
            State::Object(raw, mut obj) => {
                let mut pieces = Vec::new();
                match obj.finish(&mut pieces) {
                    End::Call => out.extend(pieces),
                    End::NotACall(body) => text_piece(raw.unwrap_or_default() + &body, out),
                }
            }
        }
    }
}

fn text_piece(t: String, out: &mut Vec<Piece>) {
    if !t.is_empty() {
        out.push(Piece::Text(t));
    }
}
