//! What every format's reader of an answer is ([`Read`]), the step form most are written in
//! ([`Steps`]), and the tag test they share.

use super::object::Piece;

/// A format's own reader of an answer: what text completes, and what is left at its end.
pub trait Read {
    fn push(&mut self, text: &str, out: &mut Vec<Piece>);
    fn finish(&mut self, out: &mut Vec<Piece>);
}

/// A reader written as steps: each takes what it can of the text and gives back the rest for the
/// state it moved to.
pub trait Steps {
    fn step(&mut self, text: String, out: &mut Vec<Piece>) -> String;
    fn end(&mut self, out: &mut Vec<Piece>);
}

impl<T: Steps> Read for T {
    fn push(&mut self, text: &str, out: &mut Vec<Piece>) {
        let mut rest = text.to_owned();
        while !rest.is_empty() {
            rest = self.step(rest, out);
        }
    }

    fn finish(&mut self, out: &mut Vec<Piece>) {
        self.end(out);
    }
}

/// How many bytes at the end of `buf` may begin `tag` (a proper prefix of it).
pub fn partial_tag_len(buf: &str, tag: &str) -> usize {
    (1..tag.len().min(buf.len() + 1))
        .rev()
        .find(|&k| buf.is_char_boundary(buf.len() - k) && tag.starts_with(&buf[buf.len() - k..]))
        .unwrap_or(0)
}

