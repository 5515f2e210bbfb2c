//! One call written as a JSON object, `{"name": "f", "arguments": {...}}` (or `"parameters"`, as
//! Llama-style models write), read as it arrives. When the object starts with its name and its
//! arguments are an object, the call opens as soon as the name is known and the arguments are
//! given out piece by piece as they arrive; any other order is read when the object is whole.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::json::ValueEnd;

/// One complete call: the function's name and its arguments as JSON text (as the model wrote
/// them; OpenAI's `function.arguments` is a string).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    pub name: String,
    pub arguments: String,
}

/// What reading a call gives out, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Content: what the model says besides its calls.
    Text(String),
    /// A call begins: its function's name.
    Open(String),
    /// More of the open call's arguments (JSON text).
    Args(String),
    /// The open call is complete: the whole of it.
    Close(Call),
}

/// An object's body as a call, if it is one (keys in any order; arguments written as a JSON
/// string of JSON are that string's content).
pub fn call_of(body: &str) -> Option<Call> {
    #[derive(Deserialize)]
    struct Body<'a> {
        name: String,
        #[serde(borrow, alias = "parameters")]
        arguments: Option<&'a RawValue>,
    }
    let b: Body = serde_json::from_str(body.trim()).ok()?;
    let arguments = match b.arguments.map(RawValue::get) {
        None | Some("null") => "{}".to_owned(),
        Some(raw) if raw.starts_with('"') => {
            let inner: String = serde_json::from_str(raw).ok()?;
            serde_json::from_str::<&RawValue>(&inner).ok()?;
            inner
        }
        Some(raw) => raw.to_owned(),
    };
    Some(Call { name: b.name, arguments })
}

/// The end of reading one object.
#[derive(Debug, PartialEq, Eq)]
pub enum End {
    /// It was a call (its pieces are given out).
    Call,
    /// It was not: its text, for the caller to give out as it sees fit.
    NotACall(String),
}

/// A call object being read: fed text from its opening `{` on.
#[derive(Clone, Debug, Default)]
pub struct CallObject {
    /// The object's text so far.
    buf: String,
    /// The object's extent.
    extent: ValueEnd,
    head: Head,
}

#[derive(Clone, Debug, Default)]
enum Head {
    /// Not yet known whether the call streams.
    #[default]
    Unknown,
    /// Streaming: the name, where the arguments start in `buf`, their extent, how much of them
    /// is given out, and where they end once they have.
    Streaming { name: String, at: usize, args: ValueEnd, sent: usize, end: Option<usize> },
    /// Read when whole.
    Whole,
}

impl CallObject {
    /// Reads `text`: the pieces it completes, and once the object has ended, how many bytes of
    /// `text` it took and how it ended.
    pub fn feed(&mut self, text: &str, out: &mut Vec<Piece>) -> Option<(usize, End)> {
        let took = self.extent.feed(text);
        let start = self.buf.len();
        self.buf.push_str(&text[..took.unwrap_or(text.len())]);
        if matches!(self.head, Head::Unknown) {
            match head(&self.buf) {
                Found::Yes(name, at) => {
                    out.push(Piece::Open(name.clone()));
                    self.head = Head::Streaming { name, at, args: ValueEnd::default(), sent: at, end: None };
                }
                Found::No => self.head = Head::Whole,
                Found::NeedMore => {}
            }
        }
        if let Head::Streaming { at, args, sent, end, .. } = &mut self.head {
            if end.is_none() {
                let from = (*sent).max(start).max(*at);
                if let Some(n) = args.feed(&self.buf[from..]) {
                    *end = Some(from + n);
                }
                let upto = end.unwrap_or(self.buf.len());
                if upto > *sent {
                    out.push(Piece::Args(self.buf[*sent..upto].to_owned()));
                    *sent = upto;
                }
            }
        }
        took.map(|n| (n, self.close(out)))
    }

    /// The text ended with the object still open.
    pub fn finish(&mut self, out: &mut Vec<Piece>) -> End {
        self.close(out)
    }

    fn close(&mut self, out: &mut Vec<Piece>) -> End {
        match std::mem::take(&mut self.head) {
            Head::Streaming { name, at, end, .. } => {
                let arguments = self.buf[at..end.unwrap_or(self.buf.len())].to_owned();
                out.push(Piece::Close(Call { name, arguments }));
                End::Call
            }
            Head::Unknown | Head::Whole => match call_of(&self.buf) {
                Some(call) => {
                    out.push(Piece::Open(call.name.clone()));
                    out.push(Piece::Args(call.arguments.clone()));
                    out.push(Piece::Close(call));
                    End::Call
                }
                None => End::NotACall(std::mem::take(&mut self.buf)),
            },
        }
    }
}

enum Found {
    /// The name, and where the arguments (an object) start.
    Yes(String, usize),
    No,
    NeedMore,
}

/// Whether `buf` starts `{"name": "<name>", "arguments": {` (any whitespace between).
fn head(buf: &str) -> Found {
    let mut c = Cursor { s: buf, at: 0 };
    let steps = (|| {
        c.lit("{")?;
        c.lit("\"name\"")?;
        c.lit(":")?;
        let name = c.string()?;
        c.lit(",")?;
        c.key_of(&["\"arguments\"", "\"parameters\""])?;
        c.lit(":")?;
        c.ws();
        match c.s[c.at..].chars().next() {
            None => Err(Step::More),
            Some('{') => Ok((name, c.at)),
            Some(_) => Err(Step::No),
        }
    })();
    match steps {
        Ok((name, at)) => Found::Yes(name, at),
        Err(Step::No) => Found::No,
        Err(Step::More) => Found::NeedMore,
    }
}

pub(super) enum Step {
    No,
    More,
}

/// A reader of JSON-ish text with a position: each step skips whitespace first.
pub(super) struct Cursor<'a> {
    pub s: &'a str,
    pub at: usize,
}

impl Cursor<'_> {
    pub fn ws(&mut self) {
        let rest = &self.s[self.at..];
        self.at += rest.len() - rest.trim_start().len();
    }

    /// `lit` after whitespace.
    pub fn lit(&mut self, lit: &str) -> Result<(), Step> {
        self.key_of(&[lit])
    }

    pub fn key_of(&mut self, lits: &[&str]) -> Result<(), Step> {
        self.ws();
        let rest = &self.s[self.at..];
        if let Some(l) = lits.iter().find(|l| rest.starts_with(**l)) {
            self.at += l.len();
            return Ok(());
        }
        match lits.iter().any(|l| l.starts_with(rest)) {
            true => Err(Step::More),
            false => Err(Step::No),
        }
    }

    /// A whole JSON string, decoded.
    pub fn string(&mut self) -> Result<String, Step> {
        self.ws();
        let rest = &self.s[self.at..];
        match rest.chars().next() {
            None => return Err(Step::More),
            Some('"') => {}
            Some(_) => return Err(Step::No),
        }
        let n = ValueEnd::default().feed(rest).ok_or(Step::More)?;
        let name: String = serde_json::from_str(&rest[..n]).map_err(|_| Step::No)?;
        self.at += n;
        Ok(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(pieces: &[&str]) -> (Vec<Piece>, Option<(usize, End)>) {
        let mut o = CallObject::default();
        let mut out = Vec::new();
        let mut at = 0;
        for p in pieces {
            if let Some((n, end)) = o.feed(p, &mut out) {
                return (out, Some((at + n, end)));
            }
            at += p.len();
        }
        (out, None)
    }

    fn args(pieces: &[Piece]) -> String {
        pieces.iter().filter_map(|p| if let Piece::Args(a) = p { Some(a.as_str()) } else { None }).collect()
    }

    #[test]
    fn a_call_streams_its_arguments_as_they_arrive() {
        let (out, end) = read(&[r#"{"name": "get_wea"#, r#"ther", "argum"#, r#"ents": {"city": "Pa"#, r#"ris", "n": [1, {"#, r#""x": "}"}]}}</tool_call>"#]);
        assert_eq!(out[0], Piece::Open("get_weather".into()));
        let arguments = r#"{"city": "Paris", "n": [1, {"x": "}"}]}"#;
        assert!(out.iter().filter(|p| matches!(p, Piece::Args(_))).count() >= 3, "{out:?}");
        assert_eq!(args(&out), arguments);
        assert_eq!(out.last(), Some(&Piece::Close(Call { name: "get_weather".into(), arguments: arguments.into() })));
        assert_eq!(end, Some((77, End::Call)));
    }

    #[test]
    fn other_orders_are_read_whole() {
        let (out, end) = read(&[r#"{"arguments": {"a": 1}, "#, r#""name": "f"} tail"#]);
        let call = Call { name: "f".into(), arguments: r#"{"a": 1}"#.into() };
        assert_eq!(out, vec![Piece::Open("f".into()), Piece::Args(call.arguments.clone()), Piece::Close(call)]);
        assert_eq!(end.map(|e| e.0), Some(36));
        // Arguments as a string of JSON: its content.
        let (out, _) = read(&[r#"{"name": "f", "arguments": "{\"a\": 1}"}"#]);
        assert_eq!(out.last(), Some(&Piece::Close(Call { name: "f".into(), arguments: r#"{"a": 1}"#.into() })));
        // No arguments: `{}`.
        let (out, _) = read(&[r#"{"name": "f"}"#]);
        assert_eq!(out.last(), Some(&Piece::Close(Call { name: "f".into(), arguments: "{}".into() })));
    }

    #[test]
    fn not_a_call_is_given_back() {
        let (out, end) = read(&[r#"{"nom": "f"}"#]);
        assert!(out.is_empty());
        assert_eq!(end, Some((12, End::NotACall(r#"{"nom": "f"}"#.into()))));
    }

    #[test]
    fn an_unfinished_call_closes_with_what_arrived() {
        let mut o = CallObject::default();
        let mut out = Vec::new();
        assert!(o.feed(r#"{"name": "f", "arguments": {"a": "#, &mut out).is_none());
        assert_eq!(o.finish(&mut out), End::Call);
        assert_eq!(out.last(), Some(&Piece::Close(Call { name: "f".into(), arguments: r#"{"a": "#.into() })));
    }
}
