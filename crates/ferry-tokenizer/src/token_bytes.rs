//! The bytes a single token stands for, for log-probability answers (OpenAI's `bytes`, and the
//! token's text): a token may hold part of a UTF-8 character, which decoding it alone would turn
//! into U+FFFD. Byte-level BPE pieces (GPT-2's alphabet: one printable character per byte) map
//! back to their bytes exactly; SentencePiece byte-fallback pieces (`<0x0A>`) are their byte;
//! `▁` is a space; added tokens (`<|im_end|>`) are their own text; anything else is decoded.

use crate::{Tokenizer, TokenizerError};
use tokenizers::decoders::DecoderWrapper;

/// GPT-2's byte-level alphabet, inverted: the byte a piece's character stands for. Bytes that are
/// printable (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) are their own character; the other 68 are
/// U+0100.. in byte order (openai/gpt-2 `encoder.py`, `bytes_to_unicode`).
fn byte_of(c: char) -> Option<u8> {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let c = c as u32;
    if c <= 0xFF {
        return printable(c).then_some(c as u8);
    }
    let n = c.checked_sub(0x100)?;
    (0u32..=255).filter(|&b| !printable(b)).nth(n as usize).map(|b| b as u8)
}

fn is_byte_level(d: Option<&DecoderWrapper>) -> bool {
    match d {
        Some(DecoderWrapper::ByteLevel(_)) => true,
        Some(DecoderWrapper::Sequence(s)) => s.get_decoders().iter().any(|d| matches!(d, DecoderWrapper::ByteLevel(_))),
        _ => false,
    }
}

impl Tokenizer {
    /// The bytes token `id` adds to a text (see the module doc). Unknown ids are an error.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>, TokenizerError> {
        let piece = self.inner.id_to_token(id).ok_or(TokenizerError::UnknownId { id, vocab_size: self.vocab_size() })?;
        if self.inner.get_added_vocabulary().simple_id_to_token(id).is_some() {
            return Ok(piece.into_bytes());
        }
        if is_byte_level(self.inner.get_decoder())
            && let Some(bytes) = piece.chars().map(byte_of).collect::<Option<Vec<u8>>>()
        {
            return Ok(bytes);
        }
        if let Some(hex) = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'))
            && hex.len() == 2
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            return Ok(vec![b]);
        }
        if piece.contains('\u{2581}') {
            return Ok(piece.replace('\u{2581}', " ").into_bytes());
        }
        Ok(self.decode(&[id], false)?.into_bytes())
    }

    /// Token `id`'s text: its bytes as UTF-8, with U+FFFD for a partial character (the exact
    /// bytes are [`Tokenizer::token_bytes`]).
    pub fn token_text(&self, id: u32) -> Result<String, TokenizerError> {
        Ok(String::from_utf8_lossy(&self.token_bytes(id)?).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_level_alphabet_inverts() {
        assert_eq!(byte_of('!'), Some(b'!'));
        assert_eq!(byte_of('\u{0120}'), Some(b' '), "Ġ is the space");
        assert_eq!(byte_of('\u{010A}'), Some(b'\n'), "Ċ is the newline");
        assert_eq!(byte_of('\u{0100}'), Some(0));
        assert_eq!(byte_of('\u{00FF}'), Some(0xFF));
        assert_eq!(byte_of(' '), None, "a raw space is not in the alphabet");
        assert_eq!(byte_of('\u{0144}'), None, "past the 68 remapped bytes");
        let all: std::collections::HashSet<u8> = (0u32..0x200).filter_map(char::from_u32).filter_map(byte_of).collect();
        assert_eq!(all.len(), 256, "every byte has one character");
    }
}
