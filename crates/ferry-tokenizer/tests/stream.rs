//! Streaming detokenization: concatenated chunks equal the full decode, and no chunk carries a
//! partial character (U+FFFD).

mod common;

use ferry_tokenizer::{StreamDecoder, Tokenizer, TokenizerError};
use proptest::prelude::*;

/// Streams `ids` one at a time; returns the chunks (the final flush included).
fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
    let mut d = StreamDecoder::new(tok, skip_special);
    let mut chunks: Vec<String> = ids.iter().filter_map(|&id| d.push(id).unwrap()).collect();
    chunks.extend(d.finish().unwrap());
    chunks
}

fn check_round_trip(tok: &Tokenizer, text: &str) {
    let ids = tok.encode(text, false).unwrap();
    let chunks = stream(tok, &ids, false);
    for c in &chunks {
        assert!(
            !c.contains('\u{FFFD}'),
            "chunk {c:?} of {text:?} has a partial character"
        );
        assert!(!c.is_empty());
    }
    assert_eq!(chunks.concat(), tok.decode(&ids, false).unwrap());
    assert_eq!(chunks.concat(), text);
}

#[test]
fn multibyte_text_smollm2() {
    let tok = common::smollm2_tokenizer();
    let text = "héllo 世界 🚀";
    let ids = tok.encode(text, false).unwrap();
    assert!(ids.len() > 5, "expect byte-level pieces: {ids:?}");
    check_round_trip(tok, text);
    check_round_trip(tok, "naïve café — 東京 🚀 and 👩‍👩‍👧 ok");
}

#[test]
fn multibyte_text_golden_bytes() {
    // 512 tokens: nearly every non-ASCII character is split into single-byte tokens.
    check_round_trip(common::golden_tokenizer(), "héllo 世界 🚀 Ωmega");
}

#[test]
fn special_tokens_in_stream() {
    let tok = common::smollm2_tokenizer();
    let ids = tok
        .encode("<|im_start|>assistant\nSure 🚀<|im_end|>", false)
        .unwrap();
    assert_eq!(
        stream(tok, &ids, false).concat(),
        "<|im_start|>assistant\nSure 🚀<|im_end|>"
    );
    assert_eq!(stream(tok, &ids, true).concat(), "assistant\nSure 🚀");
}

#[test]
fn incomplete_tail_and_unknown_ids() {
    let tok = common::smollm2_tokenizer();
    let rocket = tok.encode("🚀", false).unwrap();
    assert!(rocket.len() > 1);
    let mut d = StreamDecoder::new(tok, false);
    for &id in &rocket[..rocket.len() - 1] {
        assert_eq!(
            d.push(id).unwrap(),
            None,
            "nothing before the character completes"
        );
    }
    // The stream ends mid-character: the flush shows what a full decode shows.
    let tail = d.finish().unwrap().unwrap();
    assert_eq!(
        tail,
        tok.decode(&rocket[..rocket.len() - 1], false).unwrap()
    );
    assert_eq!(d.finish().unwrap(), None);
    assert!(matches!(
        d.push(u32::MAX),
        Err(TokenizerError::UnknownId { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_text_streams_exactly(text in "\\PC{0,40}") {
        // A literal U+FFFD in the input would rightly appear in the output.
        prop_assume!(!text.contains(char::REPLACEMENT_CHARACTER));
        let tok = common::smollm2_tokenizer();
        let ids = tok.encode(&text, false).unwrap();
        let chunks = stream(tok, &ids, false);
        prop_assert_eq!(chunks.concat(), tok.decode(&ids, false).unwrap());
        let partial = chunks.iter().any(|c| c.contains(char::REPLACEMENT_CHARACTER));
        prop_assert!(!partial, "a chunk has a partial character: {:?}", chunks);
    }
}
