//! Tool calls in generated text, read as it arrives (all at once for a whole answer, delta by
//! delta for a stream): a [`Scanner`] gives back [`Piece`]s, content and calls, a call's
//! arguments piece by piece. Both answers run the same scanner, so a stream's pieces add up to
//! the whole answer's message.
//!
//! [`Format::Hermes`]: `<tool_call>` blocks in text. Rules:
//! - text that may be the start of a tag is held back until it is known not to be;
//! - a block whose body is not a JSON object with a string `name` is content, tags and all;
//! - whitespace just before a call, between calls and at the end is dropped when a call was made
//!   (content is what the model said besides its calls); without calls, the text is unchanged;
//! - a call still open at the end of the text closes with the arguments that arrived.
//!
//! [`Format::Generic`]: the whole answer is `{"response": "…"}` (the string's decoded
//! characters are the content) or `{"tool_calls": [call, …]}`. An answer of any other shape is
//! content as it stands.
//!
//! [`Format::Llama3Json`], [`Format::Mistral`] and [`Format::Pythonic`] have their own readers
//! ([`super::llama`], [`super::mistral`], [`super::pythonic`]); their content takes the Hermes
//! rule for whitespace.
//!
//! Past `max_calls` (`parallel_tool_calls: false` allows one) further calls are dropped.

pub use super::object::{Call, Piece};

use super::format::Format;
use super::json::StrDecoder;
use super::object::{CallObject, Cursor, End, Step};
use super::read::{Read, partial_tag_len};
use super::{llama, mistral, pythonic};

/// Tool calls and content out of text that arrives in pieces (see the module doc).
#[derive(Clone, Debug)]
pub struct Scanner {
    state: State,
    max_calls: Option<usize>,
    /// Calls opened so far (dropped ones not counted).
    calls: usize,
    /// The open call is past `max_calls`: its pieces are dropped.
    dropping: bool,
    /// Whitespace held back after the last content given out (Hermes).
    ws: String,
}

#[derive(Clone, Debug)]
enum State {
    /// Hermes, outside a block: text not yet given out (a possible tag start).
    Text(String),
    /// Hermes, after `<tool_call>`: whitespace before the body's object.
    Lead(String),
    /// Hermes, a call's object (and the whitespace before it).
    Object(String, CallObject),
    /// Hermes, after the call's object: what comes before `</tool_call>` (dropped).
    After(String),
    /// Hermes, a block whose body is not an object: kept until its close tag, then content.
    Raw(String),
    /// Generic, before the answer's shape is known.
    GenericLead(String),
    /// Generic, the reply string.
    Reply(StrDecoder),
    /// Generic, in the call list, between calls.
    List,
    /// Generic, one call of the list.
    ListObject(CallObject),
    /// Generic, after the answer's object: nothing more is read.
    Tail,
    /// Generic, an answer of another shape: all content.
    Plain,
    Llama(llama::Reader),
    Mistral(mistral::Reader),
    Pythonic(pythonic::Reader),
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

impl Scanner {
    pub fn new(format: Format, max_calls: Option<usize>) -> Scanner {
        let state = match format {
            Format::Hermes => State::Text(String::new()),
            Format::Generic => State::GenericLead(String::new()),
            Format::Llama3Json => State::Llama(llama::Reader::default()),
            Format::Mistral => State::Mistral(mistral::Reader::default()),
            Format::Pythonic => State::Pythonic(pythonic::Reader::default()),
        };
        Scanner { state, max_calls, calls: 0, dropping: false, ws: String::new() }
    }

    /// Calls made so far (dropped ones not counted).
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// The pieces `text` completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        if let Some(r) = self.reader() {
            let mut read = Vec::new();
            r.push(text, &mut read);
            self.relay(read, &mut out);
            return out;
        }
        let mut rest = text.to_owned();
        while !rest.is_empty() {
            rest = self.step(rest, &mut out);
        }
        out
    }

    /// One step over `text`: what of it is left for the next state.
    fn step(&mut self, text: String, out: &mut Vec<Piece>) -> String {
        match &mut self.state {
            State::Text(buf) => {
                buf.push_str(&text);
                if let Some(start) = buf.find(OPEN) {
                    let rest = buf.split_off(start + OPEN.len());
                    buf.truncate(start);
                    let before = std::mem::take(buf);
                    self.text(&before, out);
                    self.state = State::Lead(String::new());
                    return rest;
                }
                let keep = partial_tag_len(buf, OPEN);
                let give: String = buf.drain(..buf.len() - keep).collect();
                self.text(&give, out);
                String::new()
            }
            State::Lead(lead) => {
                let trimmed = text.trim_start();
                lead.push_str(&text[..text.len() - trimmed.len()]);
                if trimmed.is_empty() {
                    return String::new();
                }
                let lead = std::mem::take(lead);
                self.state = match trimmed.starts_with('{') {
                    true => State::Object(lead, CallObject::default()),
                    false => State::Raw(lead),
                };
                trimmed.to_owned()
            }
            State::Object(lead, obj) => {
                let mut pieces = Vec::new();
                let ended = obj.feed(&text, &mut pieces);
                let lead = std::mem::take(lead);
                self.call_pieces(pieces, out);
                match ended {
                    None => {
                        if let State::Object(l, _) = &mut self.state {
                            *l = lead;
                        }
                        String::new()
                    }
                    Some((n, End::Call)) => {
                        self.state = State::After(String::new());
                        text[n..].to_owned()
                    }
                    Some((n, End::NotACall(body))) => {
                        self.state = State::Raw(lead + &body);
                        text[n..].to_owned()
                    }
                }
            }
            State::After(buf) => {
                buf.push_str(&text);
                match buf.find(CLOSE) {
                    Some(end) => {
                        let rest = buf[end + CLOSE.len()..].to_owned();
                        self.state = State::Text(String::new());
                        rest
                    }
                    None => {
                        let keep = partial_tag_len(buf, CLOSE);
                        buf.drain(..buf.len() - keep);
                        String::new()
                    }
                }
            }
            State::Raw(body) => {
                body.push_str(&text);
                match body.find(CLOSE) {
                    Some(end) => {
                        let rest = body[end + CLOSE.len()..].to_owned();
                        let block = format!("{OPEN}{}{CLOSE}", &body[..end]);
                        self.state = State::Text(String::new());
                        self.text(&block, out);
                        rest
                    }
                    None => String::new(),
                }
            }
            State::GenericLead(buf) => {
                buf.push_str(&text);
                let mut c = Cursor { s: buf, at: 0 };
                let shape = (|| {
                    c.lit("{")?;
                    c.key_of(&["\"response\"", "\"tool_calls\""])?;
                    let reply = c.s[..c.at].ends_with("\"response\"");
                    c.lit(":")?;
                    c.lit(if reply { "\"" } else { "[" })?;
                    Ok::<_, Step>(reply)
                })();
                let at = c.at;
                match shape {
                    Ok(reply) => {
                        let rest = buf[at..].to_owned();
                        self.state = if reply { State::Reply(StrDecoder::default()) } else { State::List };
                        rest
                    }
                    Err(Step::More) => String::new(),
                    Err(Step::No) => {
                        let all = std::mem::take(buf);
                        self.state = State::Plain;
                        all
                    }
                }
            }
            State::Reply(d) => {
                let (t, end) = d.feed(&text);
                if !t.is_empty() {
                    out.push(Piece::Text(t));
                }
                if end.is_some() {
                    self.state = State::Tail;
                }
                String::new()
            }
            State::List => {
                let rest = text.trim_start_matches(|c: char| c.is_whitespace() || c == ',');
                match rest.chars().next() {
                    None => String::new(),
                    Some('{') => {
                        self.state = State::ListObject(CallObject::default());
                        rest.to_owned()
                    }
                    Some(_) => {
                        self.state = State::Tail;
                        String::new()
                    }
                }
            }
            State::ListObject(obj) => {
                let mut pieces = Vec::new();
                let ended = obj.feed(&text, &mut pieces);
                self.call_pieces(pieces, out);
                match ended {
                    None => String::new(),
                    Some((n, end)) => {
                        if let End::NotACall(body) = end {
                            out.push(Piece::Text(body));
                        }
                        self.state = State::List;
                        text[n..].to_owned()
                    }
                }
            }
            State::Tail | State::Llama(_) | State::Mistral(_) | State::Pythonic(_) => String::new(),
            State::Plain => {
                out.push(Piece::Text(text));
                String::new()
            }
        }
    }

    /// The pieces left at the end of the text.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        if let Some(r) = self.reader() {
            let mut read = Vec::new();
            r.finish(&mut read);
            self.relay(read, &mut out);
        }
        match std::mem::replace(&mut self.state, State::Tail) {
            State::Text(rest) => self.text(&rest, &mut out),
            State::Lead(lead) => self.text(&format!("{OPEN}{lead}"), &mut out),
            State::Object(lead, mut obj) => {
                let mut pieces = Vec::new();
                if let End::NotACall(body) = obj.finish(&mut pieces) {
                    self.text(&format!("{OPEN}{lead}{body}"), &mut out);
                }
                self.call_pieces(pieces, &mut out);
            }
            State::ListObject(mut obj) => {
                let mut pieces = Vec::new();
                if let End::NotACall(body) = obj.finish(&mut pieces) {
                    out.push(Piece::Text(body));
                }
                self.call_pieces(pieces, &mut out);
            }
            State::Raw(body) => self.text(&format!("{OPEN}{body}"), &mut out),
            State::GenericLead(buf) if !buf.is_empty() => out.push(Piece::Text(buf)),
            State::After(_) | State::GenericLead(_) | State::Reply(_) | State::List | State::Tail | State::Plain => {}
            State::Llama(_) | State::Mistral(_) | State::Pythonic(_) => {}
        }
        if self.calls == 0 && !self.ws.is_empty() {
            out.push(Piece::Text(std::mem::take(&mut self.ws)));
        }
        self.ws.clear();
        out
    }

    /// The reader of a format that has its own.
    fn reader(&mut self) -> Option<&mut dyn Read> {
        match &mut self.state {
            State::Llama(r) => Some(r),
            State::Mistral(r) => Some(r),
            State::Pythonic(r) => Some(r),
            _ => None,
        }
    }

    /// A reader's pieces: content by the whitespace rule, calls up to `max_calls`.
    fn relay(&mut self, pieces: Vec<Piece>, out: &mut Vec<Piece>) {
        for p in pieces {
            match p {
                Piece::Text(t) => self.text(&t, out),
                p => self.call_pieces(vec![p], out),
            }
        }
    }

    /// A call's pieces, unless the call is past `max_calls`.
    fn call_pieces(&mut self, pieces: Vec<Piece>, out: &mut Vec<Piece>) {
        for p in pieces {
            if let Piece::Open(_) = p {
                self.ws.clear();
                self.dropping = self.max_calls.is_some_and(|m| self.calls >= m);
                if !self.dropping {
                    self.calls += 1;
                }
            }
            if !self.dropping {
                out.push(p);
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

#[cfg(test)]
#[path = "scan_tests.rs"]
mod tests;
