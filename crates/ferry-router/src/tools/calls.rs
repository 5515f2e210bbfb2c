//! The tool calls of one answer as the client sees them: each call gets its `call_<random>` id
//! when it opens, and the scanner's pieces become what an API streams ([`Said`]).

use super::format::Format;
use super::scan::{Call, Piece, Scanner};

/// A tool call of an answer, with the id it is answered under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdCall {
    /// `call_<random>`.
    pub id: String,
    pub call: Call,
}

/// What the answer says next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Said {
    /// Content.
    Text(String),
    /// Call `index` of the answer begins: its id and function name.
    Open { index: usize, id: String, name: String },
    /// More of call `index`'s arguments (JSON text).
    Args { index: usize, text: String },
    /// Call `index` is complete.
    Close { index: usize, call: IdCall },
}

/// The tool calls of one answer, found as its text arrives. A request for `n` choices scans each
/// with its own clone.
#[derive(Clone, Debug)]
pub struct Calls {
    scanner: Scanner,
    made: Vec<IdCall>,
    /// The id of the call open now.
    open: Option<String>,
}

impl Calls {
    pub fn new(format: Format, max_calls: Option<usize>) -> Calls {
        Calls { scanner: Scanner::new(format, max_calls), made: Vec::new(), open: None }
    }

    /// What `text` (the next of the answer's text) completes.
    pub fn push(&mut self, text: &str) -> Vec<Said> {
        let pieces = self.scanner.push(text);
        self.said(pieces)
    }

    /// What is left at the end of the answer.
    pub fn finish(&mut self) -> Vec<Said> {
        let pieces = self.scanner.finish();
        self.said(pieces)
    }

    /// How many calls the answer made so far (an open one counted).
    pub fn count(&self) -> usize {
        self.made.len() + usize::from(self.open.is_some())
    }

    /// The whole answer's content and calls.
    pub fn whole(mut self, text: &str) -> (String, Vec<IdCall>) {
        let mut content = String::new();
        for s in self.push(text).into_iter().chain(self.finish()) {
            if let Said::Text(t) = s {
                content.push_str(&t);
            }
        }
        (content, self.made)
    }

    fn said(&mut self, pieces: Vec<Piece>) -> Vec<Said> {
        pieces
            .into_iter()
            .filter_map(|p| match p {
                Piece::Text(t) => Some(Said::Text(t)),
                Piece::Open(name) => {
                    let id = new_id();
                    self.open = Some(id.clone());
                    Some(Said::Open { index: self.made.len(), id, name })
                }
                Piece::Args(text) => Some(Said::Args { index: self.made.len(), text }),
                Piece::Close(call) => {
                    let id = self.open.take()?;
                    let c = IdCall { id, call };
                    self.made.push(c.clone());
                    Some(Said::Close { index: self.made.len() - 1, call: c })
                }
            })
            .collect()
    }
}

/// OpenAI's ids look like `call_` and 24 letters and digits.
fn new_id() -> String {
    const ALNUM: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let id: String = (0..24).map(|_| ALNUM[rand::random_range(0..ALNUM.len())] as char).collect();
    format!("call_{id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_keeps_its_id_from_open_to_close() {
        let mut c = Calls::new(Format::Hermes, None);
        let said = c.push("Sure. <tool_call>{\"name\": \"f\", \"arguments\": {\"a\":");
        let [Said::Text(t), Said::Open { index: 0, id, name }, Said::Args { index: 0, text }] = &said[..] else { panic!("{said:?}") };
        assert_eq!((t.as_str(), name.as_str(), text.as_str()), ("Sure.", "f", "{\"a\":"));
        assert!(id.starts_with("call_") && id.len() == 29, "{id}");
        assert_eq!(c.count(), 1);
        let said = c.push(" 1}}</tool_call>");
        let [Said::Args { index: 0, text }, Said::Close { index: 0, call }] = &said[..] else { panic!("{said:?}") };
        assert_eq!((text.as_str(), &call.id, call.call.arguments.as_str()), (" 1}", id, "{\"a\": 1}"));
        assert_eq!(c.clone().whole(""), (String::new(), vec![call.clone()]));
    }
}
