//! Incremental detokenization for streaming responses, after text-generation-inference's
//! `decode_token`: keep a window of ids split by two offsets, decode the window with and without
//! the newest ids, and emit the difference once it no longer ends in an incomplete UTF-8 sequence
//! (U+FFFD). Decoding a window, not single tokens, gets byte-level pieces, byte-fallback tokens and
//! leading-space rules right; the window is trimmed after every emission so memory stays bounded.

use crate::{Tokenizer, TokenizerError};

use ferry_core::stop::{Released, StopMatcher};

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

/// A completion's text as it streams: ids detokenized, then stop strings applied (the stop
/// string is not returned). Stop strings are matched from the `min_tokens`-th token's text on
/// (vLLM's rule: none ends the text earlier). One per sequence: the router's relay and the
/// engine's own generate loop both use it, so the text is the same wherever it is produced.
pub struct TextStream<'a> {
    detok: StreamDecoder<'a>,
    stops: StopMatcher,
    min_tokens: usize,
    tokens: usize,
}

impl<'a> TextStream<'a> {
    pub fn new(tok: &'a Tokenizer, stop_strings: Vec<String>, min_tokens: usize) -> Self {
        TextStream { detok: StreamDecoder::new(tok, true), stops: StopMatcher::new(stop_strings), min_tokens, tokens: 0 }
    }

    /// The text one more id releases, and whether it completed a stop string.
    pub fn push(&mut self, id: u32) -> Result<(String, bool), TokenizerError> {
        self.tokens += 1;
        let Some(delta) = self.detok.push(id)? else { return Ok((String::new(), false)) };
        let r = self.release(&delta);
        Ok((r.text, r.stopped))
    }

    /// What is held back, when generation ended for another reason than a stop string.
    pub fn flush(&mut self) -> Result<String, TokenizerError> {
        let rest = self.detok.finish()?.unwrap_or_default();
        let r = self.release(&rest);
        let mut text = r.text;
        if !r.stopped {
            text.push_str(&self.stops.finish());
        }
        Ok(text)
    }

    /// `text` through the stop strings, or past them before the `min_tokens`-th token.
    fn release(&mut self, text: &str) -> Released {
        if self.tokens < self.min_tokens {
            Released { text: self.stops.pass(text), stopped: false }
        } else {
            self.stops.push(text)
        }
    }
}

#[cfg(test)]
mod text_stream_tests {
    use super::*;

    fn golden_tokenizer() -> Tokenizer {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/golden/llama-gqa/tokenizer.json");
        Tokenizer::from_json(&std::fs::read_to_string(path).unwrap(), "llama-gqa").unwrap()
    }

    #[test]
    fn stop_strings_apply_from_min_tokens_on() {
        let tok = golden_tokenizer();
        let ids = tok.encode("a b a b a b", false).unwrap();
        let run = |min_tokens| {
            let mut s = TextStream::new(&tok, vec!["a".into()], min_tokens);
            let mut text = String::new();
            for (i, &id) in ids.iter().enumerate() {
                let (t, stopped) = s.push(id).unwrap();
                text.push_str(&t);
                if stopped {
                    return (text, Some(i));
                }
            }
            text.push_str(&s.flush().unwrap());
            (text, None)
        };
        // Without min_tokens the first "a" stops the text at once.
        assert_eq!(run(0), (String::new(), Some(0)));
        // With it, the text before the min_tokens-th token is never searched.
        let (text, at) = run(3);
        assert!(at.is_some_and(|i| i >= 2), "{text:?} {at:?}");
        assert!(text.starts_with("a b"), "{text:?}");
        // A min_tokens past the end: nothing stops it, all of the text comes out.
        assert_eq!(run(ids.len() + 1), ("a b a b a b".to_string(), None));
    }

    #[test]
    fn bad_words_are_banned_as_written_and_after_a_space() {
        let tok = golden_tokenizer();
        let seqs = tok.bad_word_ids(&["the".into(), "  license".into()]).unwrap();
        let the = tok.encode("the", false).unwrap();
        let space_the = tok.encode(" the", false).unwrap();
        assert!(seqs.contains(&the), "{seqs:?}");
        // " the" is added only when it is as many tokens and starts with another one.
        assert_eq!(seqs.contains(&space_the), space_the.len() == the.len() && space_the[0] != the[0], "{seqs:?}");
        // Leading spaces of the word are not part of it.
        assert!(seqs.contains(&tok.encode("license", false).unwrap()), "{seqs:?}");
    }
}
