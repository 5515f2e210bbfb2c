//! The pythonic answer ([`Format::Pythonic`], vLLM's `pythonic`: Llama 3.2 and 4, ToolACE): the
//! whole answer is a Python list of calls with keyword arguments of Python literals,
//! `[get_weather(city="Paris", unit='celsius'), now()]`, whose arguments become JSON
//! (`{"city": "Paris", "unit": "celsius"}`, written as Python's `json.dumps` writes them, as vLLM
//! gives them).
//!
//! Read as it arrives, a call is given out whole (open, all of its arguments, close) when its
//! closing `)` arrives: its arguments are not JSON until then. Rules:
//! - an answer that does not start (after whitespace) with `[` and a call is content as written,
//!   and so is one that stops being a list of calls before its first call's `)`;
//! - after calls, the text from where the list stops being calls (`, oops` or a call cut short)
//!   is content; after the list's `]`, text is content;
//! - an empty list `[]` is content.
//!
//! Values: strings in either quote (escapes `\n \t \r \\ \' \" \a \b \f \v \0`-`\777` `\xHH`
//! `\uHHHH` `\UHHHHHHHH`, a line continuation; others kept as written, as Python does), integers,
//! floats, `True`/`False`/`None`, lists and dicts with string keys, nested; trailing commas. Not
//! read (content): triple-quoted, prefixed (`r""`, `f""`) or adjacent strings, tuples, sets,
//! positional arguments, expressions.
//!
//! The grammar of forced calls ([`super::grammar::python_kwargs`]) writes each function's arguments as
//! Python from its JSON schema.
//!
//! [`Format::Pythonic`]: super::format::Format::Pythonic

use serde_json::Value;

use super::object::{Call, Piece};
use super::read::Read;

/// A pythonic answer being read.
#[derive(Clone, Debug, Default)]
pub struct Reader {
    /// The text not yet given out: from the answer's start, or from the end of the last call.
    buf: String,
    /// A call was given out.
    called: bool,
    /// The list has ended or was not one: the rest is content.
    plain: bool,
}

impl Read for Reader {
    fn push(&mut self, text: &str, out: &mut Vec<Piece>) {
        if self.plain {
            out.push(Piece::Text(text.to_owned()));
            return;
        }
        self.buf.push_str(text);
        loop {
            match next(&self.buf, !self.called) {
                Next::Call(call, n) => {
                    self.buf.drain(..n);
                    self.called = true;
                    out.push(Piece::Open(call.name.clone()));
                    out.push(Piece::Args(call.arguments.clone()));
                    out.push(Piece::Close(call));
                }
                Next::End(n) => {
                    let rest = self.buf.split_off(n);
                    self.buf.clear();
                    self.plain = true;
                    if !rest.is_empty() {
                        out.push(Piece::Text(rest));
                    }
                    return;
                }
                Next::More => return,
                Next::No => {
                    self.plain = true;
                    out.push(Piece::Text(std::mem::take(&mut self.buf)));
                    return;
                }
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<Piece>) {
        if !self.buf.is_empty() {
            out.push(Piece::Text(std::mem::take(&mut self.buf)));
        }
    }
}

enum Next {
    /// A call, ending after this many bytes.
    Call(Call, usize),
    /// The list ends after this many bytes.
    End(usize),
    More,
    No,
}

/// Why a value could not be read: the text may go on to make it one, or it cannot.
#[derive(Debug, PartialEq)]
enum Stop {
    More,
    No,
}

/// What `s` starts with: the first call of the list (`first`: after whitespace and `[`), else
/// the next call (after `,`) or the list's end.
fn next(s: &str, first: bool) -> Next {
    let mut p = Py { s, at: 0 };
    let step = (|| {
        p.ws();
        if first {
            p.eat('[')?;
        } else {
            if p.peek()? == ',' {
                p.at += 1;
                p.ws();
            }
            if p.peek()? == ']' {
                p.at += 1;
                return Ok(None);
            }
            if s[..p.at].trim_start().is_empty() {
                return Err(Stop::No);
            }
        }
        p.call().map(Some)
    })();
    match step {
        Ok(Some(call)) => Next::Call(call, p.at),
        Ok(None) => Next::End(p.at),
        Err(Stop::More) => Next::More,
        Err(Stop::No) => Next::No,
    }
}

/// A reader of Python literals with a position.
struct Py<'a> {
    s: &'a str,
    at: usize,
}

impl Py<'_> {
    fn ws(&mut self) {
        let rest = &self.s[self.at..];
        self.at += rest.len() - rest.trim_start().len();
    }

    fn peek(&self) -> Result<char, Stop> {
        self.s[self.at..].chars().next().ok_or(Stop::More)
    }

    /// `c` after whitespace.
    fn eat(&mut self, c: char) -> Result<(), Stop> {
        self.ws();
        match self.peek()? == c {
            true => {
                self.at += c.len_utf8();
                Ok(())
            }
            false => Err(Stop::No),
        }
    }

    fn ident(&mut self) -> Result<&str, Stop> {
        let start = self.at;
        let rest = &self.s[start..];
        match rest.chars().next() {
            None => return Err(Stop::More),
            Some(c) if c.is_alphabetic() || c == '_' => {}
            Some(_) => return Err(Stop::No),
        }
        let n = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).ok_or(Stop::More)?;
        self.at += n;
        Ok(&self.s[start..start + n])
    }

    /// `name(key=value, ...)`, its arguments as JSON.
    fn call(&mut self) -> Result<Call, Stop> {
        self.ws();
        let name = self.ident()?.to_owned();
        self.eat('(')?;
        let mut args = Vec::new();
        loop {
            self.ws();
            if self.peek()? == ')' {
                self.at += 1;
                break;
            }
            let key = self.ident()?.to_owned();
            self.eat('=')?;
            if self.peek()? == '=' {
                return Err(Stop::No);
            }
            args.push(format!("{}: {}", Value::from(key), self.value()?));
            self.ws();
            match self.peek()? {
                ',' => self.at += 1,
                ')' => {}
                _ => return Err(Stop::No),
            }
        }
        Ok(Call { name, arguments: format!("{{{}}}", args.join(", ")) })
    }

    /// One literal, as JSON text.
    fn value(&mut self) -> Result<String, Stop> {
        self.ws();
        match self.peek()? {
            q @ ('"' | '\'') => {
                self.at += 1;
                Ok(Value::from(self.string(q)?).to_string())
            }
            '[' => {
                self.at += 1;
                let items = self.items(']', |p| p.value())?;
                Ok(format!("[{}]", items.join(", ")))
            }
            '{' => {
                self.at += 1;
                let items = self.items('}', |p| {
                    p.ws();
                    let q = p.peek()?;
                    if q != '"' && q != '\'' {
                        return Err(Stop::No);
                    }
                    p.at += 1;
                    let key = Value::from(p.string(q)?).to_string();
                    p.eat(':')?;
                    Ok(format!("{key}: {}", p.value()?))
                })?;
                Ok(format!("{{{}}}", items.join(", ")))
            }
            c if c.is_ascii_digit() || matches!(c, '-' | '+' | '.') => self.number(),
            _ => match self.ident()? {
                "True" => Ok("true".into()),
                "False" => Ok("false".into()),
                "None" => Ok("null".into()),
                _ => Err(Stop::No),
            },
        }
    }

    /// Items up to `close` (after the opening bracket), separated by commas, one trailing
    /// allowed.
    fn items(&mut self, close: char, mut item: impl FnMut(&mut Self) -> Result<String, Stop>) -> Result<Vec<String>, Stop> {
        let mut items = Vec::new();
        loop {
            self.ws();
            if self.peek()? == close {
                self.at += 1;
                return Ok(items);
            }
            items.push(item(self)?);
            self.ws();
            match self.peek()? {
                ',' => self.at += 1,
                c if c == close => {}
                _ => return Err(Stop::No),
            }
        }
    }

    fn number(&mut self) -> Result<String, Stop> {
        let rest = &self.s[self.at..];
        let n = rest.find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '+'))).ok_or(Stop::More)?;
        // `1e-5` and `-5` have signs; `1-5` does not parse below.
        let text = rest[..n].replace('_', "");
        self.at += n;
        let (sign, digits) = match text.strip_prefix('-') {
            Some(d) => ("-", d),
            None => ("", text.strip_prefix('+').unwrap_or(&text)),
        };
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            let trimmed = digits.trim_start_matches('0');
            return Ok(format!("{sign}{}", if trimmed.is_empty() { "0" } else { trimmed }));
        }
        let ok = digits.bytes().next().is_some_and(|b| b.is_ascii_digit() || b == b'.') && digits.bytes().all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'-' | b'+'));
        let f: f64 = if ok { digits.parse().map_err(|_| Stop::No)? } else { return Err(Stop::No) };
        let n = serde_json::Number::from_f64(f).ok_or(Stop::No)?;
        Ok(format!("{sign}{n}"))
    }

    /// A string's content after its opening quote `q`, through its closing one.
    fn string(&mut self, q: char) -> Result<String, Stop> {
        let mut out = String::new();
        let mut chars = self.s[self.at..].char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '\n' | '\r' => return Err(Stop::No),
                c if c == q => {
                    self.at += i + 1;
                    return Ok(out);
                }
                '\\' => {
                    let (_, e) = chars.next().ok_or(Stop::More)?;
                    let hex = |chars: &mut std::str::CharIndices, n: usize| -> Result<char, Stop> {
                        let mut v = 0u32;
                        for _ in 0..n {
                            let (_, d) = chars.next().ok_or(Stop::More)?;
                            v = v * 16 + d.to_digit(16).ok_or(Stop::No)?;
                        }
                        char::from_u32(v).ok_or(Stop::No)
                    };
                    match e {
                        'n' => out.push('\n'),
                        't' => out.push('\t'),
                        'r' => out.push('\r'),
                        'a' => out.push('\u{7}'),
                        'b' => out.push('\u{8}'),
                        'f' => out.push('\u{c}'),
                        'v' => out.push('\u{b}'),
                        '\\' | '\'' | '"' => out.push(e),
                        '\n' => {}
                        'x' => out.push(hex(&mut chars, 2)?),
                        'u' => out.push(hex(&mut chars, 4)?),
                        'U' => out.push(hex(&mut chars, 8)?),
                        '0'..='7' => {
                            let mut v = e.to_digit(8).unwrap_or(0);
                            for _ in 0..2 {
                                match chars.clone().next() {
                                    None => return Err(Stop::More),
                                    Some((_, d)) if d.is_digit(8) => {
                                        v = v * 8 + d.to_digit(8).unwrap_or(0);
                                        chars.next();
                                    }
                                    Some(_) => break,
                                }
                            }
                            out.push(char::from_u32(v).ok_or(Stop::No)?);
                        }
                        'N' => return Err(Stop::No),
                        e => {
                            out.push('\\');
                            out.push(e);
                        }
                    }
                }
                c => out.push(c),
            }
        }
        Err(Stop::More)
    }
}
