//! The grammars of issue 32's attack, each refused quickly with a clean message; and the same
//! attacks with the text limits lifted, to show the compile pool's stack and llguidance's fuel
//! hold on their own (a stack overflow here would abort the test process).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_core::sampling::OutputGrammar;

use super::tests::tokenizer;
use super::*;

/// `start: r1`, `r1: "x1" | r2`, ..., `rN: "xN"`: N + 1 rules chained.
pub fn chain(n: usize) -> String {
    let mut s = String::from("start: r1\n");
    for i in 1..n {
        s += &format!("r{i}: \"x{i}\" | r{}\n", i + 1);
    }
    s + &format!("r{n}: \"x{n}\"\n")
}

fn nested_schema(depth: usize) -> String {
    let mut s = r#"{"type":"integer"}"#.to_string();
    for _ in 0..depth {
        s = format!(r#"{{"type":"array","items":{s}}}"#);
    }
    s
}

/// The refusal of `g` under `limits`, checked clean and quick.
fn refused(g: &Grammars, grammar: &OutputGrammar) -> GrammarError {
    let t0 = Instant::now();
    let e = g.check(grammar).expect_err("refused");
    let took = t0.elapsed();
    let text = e.to_string();
    assert!(took < Duration::from_secs(5), "{text}: took {took:?}");
    assert_clean(&text);
    e
}

pub fn assert_clean(text: &str) {
    assert!(text.len() < 500, "{text}");
    assert!(!text.contains('\n'), "{text}");
    for bad in ["panicked", "panic:", "src/", "RUST_BACKTRACE", "stack backtrace", "<state>", ".rs:"] {
        assert!(!text.contains(bad), "{bad:?} in {text}");
    }
}

fn attacks() -> Vec<(&'static str, OutputGrammar)> {
    vec![
        ("1000-rule chain", OutputGrammar::Lark(chain(1000))),
        ("5000-rule chain", OutputGrammar::Lark(chain(5000))),
        ("100,000 choices", OutputGrammar::Choice((0..100_000).map(|i| format!("choice {i}")).collect())),
        ("a{1000}{1000}", OutputGrammar::Regex("a{1000}{1000}".into())),
        ("deep regex", OutputGrammar::Regex(format!("{}a{}", "(".repeat(2000), ")".repeat(2000)))),
        ("deep Lark", OutputGrammar::Lark(format!("start: {}\"a\"{}", "(".repeat(2000), ")".repeat(2000)))),
        ("deep schema", OutputGrammar::JsonSchema(nested_schema(100))),
        ("huge Lark", OutputGrammar::Lark(format!("start: \"{}\"", "a".repeat(100_000)))),
    ]
}

#[test]
fn each_attack_is_refused_by_a_limit_quickly() {
    let g = Grammars::new(&tokenizer(), None).unwrap();
    for (name, grammar) in attacks() {
        let e = refused(&g, &grammar);
        assert!(matches!(e, GrammarError::Limit { .. }), "{name}: {e}");
    }
}

#[test]
fn a_ref_cycle_is_refused_cleanly_before_any_worker_sees_it() {
    let g = Grammars::new(&tokenizer(), None).unwrap();
    for schema in [
        r##"{"$ref":"#"}"##,
        r##"{"$ref":"#/$defs/A","$defs":{"A":{"$ref":"#/$defs/B"},"B":{"$ref":"#/$defs/A"}}}"##,
        // Compiles in llguidance, and then never lets the value end (`{"a":{"a":…`).
        r##"{"$ref":"#/$defs/a","$defs":{"a":{"type":"object","properties":{"a":{"$ref":"#/$defs/a"}},"required":["a"]}}}"##,
    ] {
        let e = refused(&g, &OutputGrammar::JsonSchema(schema.into()));
        assert!(matches!(e, GrammarError::Invalid { kind: GrammarKind::JsonSchema, .. }), "{schema}: {e}");
    }
}

/// With the text limits lifted, the attacks still end quickly under llguidance's own fuel
/// limits, in a clean answer either way (on this 512-token fixture `a{1000}{1000}` compiles; on
/// SmolLM2's 49k vocabulary its first mask runs out of fuel: both are what the worker would get).
#[test]
fn without_text_limits_llguidance_fuel_still_bounds_the_attacks() {
    let lifted = Limits { max_repetition: u64::MAX, max_nesting: usize::MAX, ..Limits::default() };
    let g = Grammars::with_limits(&tokenizer(), None, lifted).unwrap();
    for rx in ["a{1000}{1000}", "(a{100}){100}{100}"] {
        let t0 = Instant::now();
        let r = g.check(&OutputGrammar::Regex(rx.into()));
        assert!(t0.elapsed() < Duration::from_secs(10), "{rx}: {:?}", t0.elapsed());
        if let Err(e) = r {
            assert_clean(&e.to_string());
        }
    }
}

/// A 5000-rule chain compiled on the pool (64 MiB stacks) with the rule limit lifted: whatever
/// llguidance answers, the process survives it (on a 2 MiB runtime thread, 1000 rules aborted).
#[tokio::test(flavor = "current_thread")]
async fn a_long_chain_does_not_overflow_the_pool_stack() {
    let lifted = Limits { max_lark_rules: 100_000, max_text_bytes: 1 << 20, ..Limits::default() };
    let cfg = PoolConfig { compile_budget: Duration::from_secs(20), ..PoolConfig::default() };
    let lazy = LazyGrammars::with_config(Arc::new(tokenizer()), None, lifted, cfg);
    match lazy.check(&OutputGrammar::Lark(chain(5000))).await {
        Ok(()) => {}
        Err(e) => assert_clean(&e.to_string()),
    }
}

#[tokio::test(flavor = "current_thread")]
async fn the_pool_accepts_valid_grammars_and_refuses_attacks() {
    let lazy = LazyGrammars::new(Arc::new(tokenizer()), None);
    // Positive controls: these must compile, or every refusal above proves nothing.
    for ok in [
        OutputGrammar::Lark(chain(300)),
        OutputGrammar::Choice((0..1000).map(|i| format!("c{i}")).collect()),
        OutputGrammar::Regex("[0-9]{3}-(ab|cd){2}".into()),
        OutputGrammar::JsonSchema(nested_schema(20)),
        OutputGrammar::JsonObject,
    ] {
        lazy.check(&ok).await.unwrap_or_else(|e| panic!("{ok:?}: {e}"));
    }
    for (name, bad) in attacks() {
        let e = lazy.check(&bad).await.expect_err(name);
        assert_clean(&e.to_string());
    }
    let c = lazy.constraint(&OutputGrammar::Regex("[0-9]+".into()), &[]).await.unwrap();
    assert!(!c.is_finished());
}
