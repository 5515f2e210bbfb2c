//! `Tokenizer::token_bytes`: the bytes of a text's tokens, one by one, spell the text exactly,
//! multi-byte characters split across tokens included (decoding such a token alone would give
//! U+FFFD); special tokens are their own text.

mod common;

use common::{golden_tokenizer, smollm2_tokenizer};
use ferry_tokenizer::Tokenizer;

const TEXTS: &[&str] = &[
    "The capital of France is Paris.",
    "héllo wörld — ünïcode ✓ 東京 🚀\n\ttabs  and   spaces",
    "Permission is hereby granted, free of charge, to any person obtaining a copy",
];

fn spells(tok: &Tokenizer, what: &str) {
    for text in TEXTS {
        let ids = tok.encode(text, false).unwrap();
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id).unwrap()).collect();
        assert_eq!(String::from_utf8_lossy(&bytes), *text, "{what}: {ids:?}");
        assert_eq!(bytes, text.as_bytes(), "{what}");
    }
    // Some token is part of a character: its text has U+FFFD, its bytes do not lie.
    let ids = tok.encode("🚀", false).unwrap();
    if ids.len() > 1 {
        assert!(tok.token_text(ids[0]).unwrap().contains('\u{FFFD}'), "{what}");
    }
    assert!(tok.token_bytes(u32::MAX).is_err(), "{what}: an unknown id is an error");
}

#[test]
fn golden_tokens_spell_the_text() {
    let tok = golden_tokenizer();
    spells(tok, "golden");
    assert_eq!(tok.token_text(2).unwrap(), "<|im_end|>", "special tokens are their own text");
}

/// Says that test `test` cannot run and why, as one `SKIPPED: test: why` line straight to stderr
/// (past the test harness's capture): `.ci/run` fails on any such line it does not allow.
fn skipped(test: &str, why: &dyn std::fmt::Display) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("\nSKIPPED: {test}: {why}\n").as_bytes());
}

#[test]
fn smollm2_tokens_spell_the_text() {
    if std::env::var_os("FERRY_SMOLLM2_GGUF").is_none() {
        skipped("token_bytes::smollm2_tokens_spell_the_text", &"FERRY_SMOLLM2_GGUF is not set");
        return;
    }
    let tok = smollm2_tokenizer();
    spells(tok, "smollm2");
    assert_eq!(tok.token_text(2).unwrap(), "<|im_end|>");
}
