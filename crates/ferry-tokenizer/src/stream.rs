//! Incremental detokenization for streaming responses, after text-generation-inference's
//! `decode_token`: keep a window of ids split by two offsets, decode the window with and without
//! the newest ids, and emit the difference once it no longer ends in an incomplete UTF-8 sequence
//! (U+FFFD). Decoding a window, not single tokens, gets byte-level pieces, byte-fallback tokens and
//! leading-space rules right; the window is trimmed after every emission so memory stays bounded.

use crate::{Tokenizer, TokenizerError};

const REPLACEMENT: char = '\u{FFFD}';

pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    ids: Vec<u32>,
    /// Start of the context decoded only to measure what was already emitted.
    prefix_offset: usize,
    /// End of what has been emitted.
    read_offset: usize,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tok: &'a Tokenizer, skip_special: bool) -> Self {
        StreamDecoder {
            tok,
            skip_special,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Adds one id; returns the text it completes, if any. Never returns a partial character.
    pub fn push(&mut self, id: u32) -> Result<Option<String>, TokenizerError> {
        if self.tok.id_to_token(id).is_none() {
            return Err(TokenizerError::UnknownId {
                id,
                vocab_size: self.tok.vocab_size(),
            });
        }
        self.ids.push(id);
        let (prefix, full) = self.decode_window()?;
        if full.len() > prefix.len() && !full.ends_with(REPLACEMENT) {
            Ok(Some(self.advance(&prefix, &full)))
        } else {
            Ok(None)
        }
    }

    /// Flushes whatever is held back at the end of the stream (an incomplete trailing character
    /// comes out as U+FFFD, exactly as a full decode would show it).
    pub fn finish(&mut self) -> Result<Option<String>, TokenizerError> {
        if self.read_offset == self.ids.len() {
            return Ok(None);
        }
        let (prefix, full) = self.decode_window()?;
        let out = self.advance(&prefix, &full);
        Ok((!out.is_empty()).then_some(out))
    }

    fn decode_window(&self) -> Result<(String, String), TokenizerError> {
        let prefix = self.tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = self
            .tok
            .decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        Ok((prefix, full))
    }

    /// Returns `full` past `prefix` and slides the window forward.
    fn advance(&mut self, prefix: &str, full: &str) -> String {
        let out = new_suffix(prefix, full).to_owned();
        self.ids.drain(..self.read_offset);
        self.prefix_offset = 0;
        self.read_offset = self.ids.len();
        out
    }
}

/// The part of `full` after `prefix`. Decoding a longer window normally only appends; if it ever
/// rewrites earlier text, cut at the nearest character boundary rather than panic.
fn new_suffix<'s>(prefix: &str, full: &'s str) -> &'s str {
    if let Some(rest) = full.strip_prefix(prefix) {
        return rest;
    }
    let mut at = prefix.len().min(full.len());
    while !full.is_char_boundary(at) {
        at -= 1;
    }
    &full[at..]
}

#[cfg(test)]
mod tests {
    use super::new_suffix;

    #[test]
    fn suffix_cases() {
        assert_eq!(new_suffix("ab", "abc"), "c");
        assert_eq!(new_suffix("", "héllo"), "héllo");
        assert_eq!(new_suffix("xé", "aé世"), "世");
        assert_eq!(new_suffix("abcdef", "ab"), "");
    }
}
