//! Constraints driven by a seeded random walk over the allowed tokens of the golden fixtures'
//! byte-level BPE tokenizer (512 tokens): whatever the walk picks, the text must satisfy the
//! grammar, checked by an independent parser (serde_json) or by hand.

use std::path::PathBuf;

use ferry_core::sampling::OutputGrammar;
use ferry_tokenizer::{ModelText, Tokenizer};
use serde_json::Value;

use super::*;

pub fn tokenizer() -> Tokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden/llama-gqa");
    ModelText::from_hf_dir(&dir).expect("fixture tokenizer").tokenizer
}

/// A model whose logits are 8 wider than the tokenizer (as real models pad their vocabularies).
fn grammars() -> (Grammars, Tokenizer) {
    let tok = tokenizer();
    (Grammars::new(&tok, Some(tok.vocab_size() + 8)).expect("grammars"), tok)
}

/// xorshift64*: the walk's randomness, seeded.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

/// Samples uniformly among allowed tokens until the grammar finishes (or an EOS is drawn, or
/// `max` tokens); returns the tokens without the EOS, and whether the walk ended properly.
fn walk(g: &Grammars, tok: &Tokenizer, grammar: &OutputGrammar, seed: u64, max: usize) -> (Vec<u32>, bool) {
    let mut c = g.constraint(grammar, &[]).expect("compiles");
    let mut state = seed | 1;
    let mut out = Vec::new();
    for _ in 0..max {
        let mut logits = vec![0.0f32; g.vocab()];
        c.mask(&mut logits).expect("mask");
        let allowed: Vec<u32> = (0..logits.len() as u32).filter(|&i| logits[i as usize] == 0.0).collect();
        assert!(!allowed.is_empty(), "the mask allowed nothing after {out:?}");
        assert!(allowed.iter().all(|&i| (i as usize) < tok.vocab_size()), "a padding id was allowed");
        let t = allowed[(next(&mut state) % allowed.len() as u64) as usize];
        if tok.eos_ids().contains(&t) {
            return (out, true);
        }
        c.commit(t).expect("an allowed token commits");
        out.push(t);
        if c.is_finished() {
            return (out, true);
        }
    }
    (out, false)
}

#[test]
fn json_schema_walks_always_parse_and_validate() {
    let (g, tok) = grammars();
    let schema = r#"{"type":"object","properties":{
        "kind":{"enum":["cat","dog"]},
        "age":{"type":"integer","minimum":0,"maximum":30},
        "ok":{"type":"boolean"},
        "tags":{"type":"array","items":{"type":"string","maxLength":3},"maxItems":2}},
        "required":["kind","age","ok","tags"],"additionalProperties":false}"#;
    let grammar = OutputGrammar::JsonSchema(schema.into());
    for seed in 1..=20u64 {
        let (ids, ended) = walk(&g, &tok, &grammar, seed, 400);
        let text = tok.decode(&ids, false).unwrap();
        assert!(ended, "seed {seed}: no end in 400 tokens: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: not JSON ({e}): {text}"));
        assert!(matches!(v["kind"].as_str(), Some("cat" | "dog")), "{text}");
        assert!((0..=30).contains(&v["age"].as_i64().expect("integer age")), "{text}");
        assert!(v["ok"].is_boolean(), "{text}");
        let tags = v["tags"].as_array().expect("tags");
        assert!(tags.len() <= 2 && tags.iter().all(|t| t.as_str().is_some_and(|s| s.chars().count() <= 3)), "{text}");
        assert_eq!(v.as_object().unwrap().len(), 4, "{text}");
        // Compact: no whitespace outside strings (this schema's strings are short).
        assert!(!text.contains(": ") && !text.contains(", "), "{text}");
    }
}

#[test]
fn json_object_mode_yields_objects() {
    let (g, tok) = grammars();
    let mut completed = 0;
    for seed in 1..=10u64 {
        let (ids, ended) = walk(&g, &tok, &OutputGrammar::JsonObject, seed, 300);
        let text = tok.decode(&ids, false).unwrap();
        if ended {
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: not JSON ({e}): {text}"));
            assert!(v.is_object(), "{text}");
            completed += 1;
        } else {
            // A random walk may wander inside a long string; the prefix must still be an object.
            assert!(text.starts_with('{'), "{text}");
        }
    }
    // A matcher that never lets an object end would pass the loop above with no object checked.
    assert!(completed >= JSON_OBJECT_WALKS_COMPLETED, "only {completed} of 10 walks completed an object (at least {JSON_OBJECT_WALKS_COMPLETED} do)");
}

/// How many of the seeded walks must complete (of 10; these seeds and this tokenizer complete 8
/// JSON objects and 10 Lark sentences as of 2026-12-05): the walks' own assertions hold only for
/// walks that end, so a matcher that never completes would otherwise pass with none checked.
const JSON_OBJECT_WALKS_COMPLETED: usize = 5;
const LARK_WALKS_COMPLETED: usize = 8;

#[test]
fn regex_and_choice_walks_match() {
    let (g, tok) = grammars();
    let rx = OutputGrammar::Regex("[0-9]{3}-(ab|cd)".into());
    let choice = OutputGrammar::Choice(vec!["yes".into(), "no".into(), "a \"quoted\" | maybe".into()]);
    for seed in 1..=15u64 {
        let (ids, ended) = walk(&g, &tok, &rx, seed, 50);
        let text = tok.decode(&ids, false).unwrap();
        assert!(ended, "{text}");
        let b = text.as_bytes();
        assert!(b.len() == 6 && b[..3].iter().all(u8::is_ascii_digit) && b[3] == b'-' && matches!(&text[4..], "ab" | "cd"), "{text:?}");
        let (ids, ended) = walk(&g, &tok, &choice, seed, 50);
        let text = tok.decode(&ids, false).unwrap();
        assert!(ended && ["yes", "no", "a \"quoted\" | maybe"].contains(&text.as_str()), "{text:?}");
    }
}

#[test]
fn lark_grammar_walks_match() {
    let (g, tok) = grammars();
    let lark = OutputGrammar::Lark("start: \"(\" NUM (\"+\" NUM)* \")\"\nNUM: /[1-9]/".into());
    let mut completed = 0;
    for seed in 1..=10u64 {
        let (ids, ended) = walk(&g, &tok, &lark, seed, 60);
        let text = tok.decode(&ids, false).unwrap();
        if !ended {
            // Unfinished in 60 tokens: still a prefix of the language.
            assert!(text.starts_with('(') && !text.contains(')'), "{text:?}");
            continue;
        }
        let inner = text.strip_prefix('(').and_then(|t| t.strip_suffix(')')).unwrap_or_else(|| panic!("{text:?}"));
        assert!(inner.split('+').all(|n| n.len() == 1 && n.as_bytes()[0].is_ascii_digit() && n != "0"), "{text:?}");
        completed += 1;
    }
    // A matcher that never completes would pass the loop above with no assertion made.
    assert!(completed >= LARK_WALKS_COMPLETED, "only {completed} of 10 walks completed (at least {LARK_WALKS_COMPLETED} do)");
}

#[test]
fn replay_reaches_the_same_state() {
    let (g, tok) = grammars();
    let grammar = OutputGrammar::JsonSchema(r#"{"type":"object","properties":{"n":{"type":"integer"},"s":{"type":"string"}},"required":["n","s"]}"#.into());
    let (ids, _) = walk(&g, &tok, &grammar, 7, 12);
    for k in 0..ids.len() {
        // One worker committed ids[..k] while sampling; another rebuilds from the grammar and
        // those tokens (the decode worker after prefill's first token, or after a migration).
        let mut a = g.constraint(&grammar, &[]).unwrap();
        for &t in &ids[..k] {
            a.commit(t).unwrap();
        }
        let mut b = g.constraint(&grammar, &ids[..k]).unwrap();
        let (mut la, mut lb) = (vec![0.0f32; g.vocab()], vec![0.0f32; g.vocab()]);
        a.mask(&mut la).unwrap();
        b.mask(&mut lb).unwrap();
        assert_eq!(la, lb, "masks differ after replaying {k} tokens");
    }
}

#[test]
fn a_token_outside_the_grammar_is_refused() {
    let (g, tok) = grammars();
    let grammar = OutputGrammar::Regex("[0-9]+".into());
    let letter = tok.encode("x", false).unwrap()[0];
    assert!(matches!(g.constraint(&grammar, &[letter]), Err(GrammarError::Matcher(_))));
}

#[test]
fn invalid_grammars_are_named() {
    let (g, _) = grammars();
    let bad = [
        (OutputGrammar::JsonSchema("{not json".into()), GrammarKind::JsonSchema),
        (OutputGrammar::JsonSchema("[1,2]".into()), GrammarKind::JsonSchema),
        (OutputGrammar::JsonSchema(r#"{"type":"frobnicate"}"#.into()), GrammarKind::JsonSchema),
        (OutputGrammar::Regex("(unclosed".into()), GrammarKind::Regex),
        (OutputGrammar::Lark("start: undefined_rule".into()), GrammarKind::Lark),
        (OutputGrammar::Lark("  ".into()), GrammarKind::Lark),
        (OutputGrammar::Choice(vec![]), GrammarKind::Choice),
    ];
    for (grammar, kind) in bad {
        match g.check(&grammar) {
            Err(GrammarError::Invalid { kind: k, message }) => {
                assert_eq!(k, kind, "{grammar:?}: {message}");
                assert!(!message.is_empty());
            }
            other => panic!("{grammar:?} gave {other:?}"),
        }
    }
    assert!(g.check(&OutputGrammar::JsonSchema(r##"{"type":"object","properties":{"a":{"$ref":"#/$defs/A"}},"$defs":{"A":{"type":"integer"}}}"##.into())).is_ok());
}
