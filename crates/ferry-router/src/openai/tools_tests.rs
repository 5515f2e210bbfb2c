use std::path::PathBuf;

use ferry_core::sampling::OutputGrammar;
use serde_json::{Value, json};

use super::*;
use crate::tools::format::Format;
use crate::tools::grammar;
use crate::tools::scan::{Piece, Scanner};

fn p(v: Value) -> Result<Option<Asked>, ApiError> {
    parse(v.as_object().expect("an object"))
}

fn weather() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather", "description": "Weather.", "strict": true,
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
        }, "required": ["city", "unit"], "additionalProperties": false}
    }})
}

fn clock() -> Value {
    json!({"type": "function", "function": {"name": "now"}})
}

#[test]
fn choices_and_defaults() {
    assert_eq!(p(json!({})).unwrap(), None);
    assert_eq!(p(json!({"tools": [], "tool_choice": "none"})).unwrap(), None);
    assert_eq!(p(json!({"tool_choice": "auto"})).unwrap().map(|a| a.active()), Some(false));
    let a = p(json!({"tools": [weather(), clock()]})).unwrap().unwrap();
    assert_eq!((a.choice.clone(), a.parallel, a.active(), a.forces(), a.max_calls()), (Choice::Auto, true, true, false, None));
    assert_eq!(a.tools[1].parameters, json!({"type": "object", "properties": {}, "additionalProperties": false}));
    assert_eq!(a.offered, vec![weather(), clock()], "the template gets the tools as sent");
    // Strict arguments: an object that says nothing is closed; one that allows more is refused.
    let open = |strict: bool| json!({"type": "function", "function": {"name": format!("f_{strict}"), "strict": strict, "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}});
    let a = p(json!({"tools": [open(true), open(false)]})).unwrap().unwrap();
    assert_eq!(a.tools[0].parameters["additionalProperties"], json!(false));
    assert_eq!(a.tools[1].parameters.get("additionalProperties"), None, "not strict: the schema's own default");
    let loose = json!({"type": "function", "function": {"name": "f", "strict": true, "parameters": {"type": "object", "additionalProperties": true}}});
    let e = p(json!({"tools": [loose]})).unwrap_err();
    assert!(e.message.contains("`strict: true` allows no properties beyond those listed"), "{}", e.message);
    let a = p(json!({"tools": [weather()], "tool_choice": "none"})).unwrap().unwrap();
    assert!(!a.active());
    let a = p(json!({"tools": [weather()], "tool_choice": "required", "parallel_tool_calls": false})).unwrap().unwrap();
    assert_eq!((a.choice.clone(), a.forces(), a.max_calls()), (Choice::Required, true, Some(1)));
    let a = p(json!({"tools": [weather(), clock()], "tool_choice": {"type": "function", "function": {"name": "now"}}})).unwrap().unwrap();
    assert_eq!((a.choice.clone(), a.max_calls()), (Choice::Named("now".into()), Some(1)));
}

#[test]
fn refusals_name_the_field() {
    for (body, field, needle) in [
        (json!({"tools": {}}), "tools", "must be an array"),
        (json!({"tools": [1]}), "tools", "`tools[0]`: must be an object"),
        (json!({"tools": [{"type": "code_interpreter"}]}), "tools", "only \"function\""),
        (json!({"tools": [{"function": {"name": "f"}}]}), "tools", "`type` is required"),
        (json!({"tools": [{"type": "function"}]}), "tools", "`function` is required"),
        (json!({"tools": [{"type": "function", "function": {}}]}), "tools", "`function.name` is required"),
        (json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}), "tools", "must be 1 to 64"),
        (json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}), "tools", "JSON schema object"),
        (json!({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]}), "tools", "description"),
        (json!({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}), "tools", "unknown field `function.extra`"),
        (json!({"tools": [clock(), clock()]}), "tools", "offered twice"),
        (json!({"tools": [clock()], "tool_choice": "any"}), "tool_choice", "not one of"),
        (json!({"tools": [clock()], "tool_choice": 3}), "tool_choice", "a string or an object"),
        (json!({"tool_choice": "required"}), "tool_choice", "needs `tools`"),
        (json!({"tools": [clock()], "tool_choice": {"type": "function", "function": {"name": "later"}}}), "tool_choice", "\"later\", which is not in `tools` (now)"),
        (json!({"tools": [clock()], "tool_choice": {"type": "allowed_tools"}}), "tool_choice", "not supported"),
        (json!({"tools": [clock()], "tool_choice": {"type": "function"}}), "tool_choice", "`tool_choice.function.name` is required"),
        (json!({"tools": [clock()], "parallel_tool_calls": "no"}), "parallel_tool_calls", "a boolean"),
    ] {
        let e = p(body.clone()).expect_err(&body.to_string());
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(field)), "{body}: {}", e.message);
        assert!(e.message.contains(needle), "{body}: {}", e.message);
    }
}

/// xorshift64*: the walk's randomness, seeded.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

/// Forced calls, sampled uniformly among the tokens the grammar allows (the golden fixtures'
/// 512-token tokenizer), always parse back into calls to the allowed functions whose arguments
/// satisfy the schema.
#[test]
fn forced_calls_walk_back_through_the_parser() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden/qwen2-bias-tied");
    let tok = ferry_tokenizer::ModelText::from_hf_dir(&dir).expect("fixture tokenizer").tokenizer;
    let grammars = ferry_grammar::Grammars::new(&tok, None).expect("grammars");
    let forcing = [(Choice::Required, false), (Choice::Required, true), (Choice::Named("get_weather".into()), true)];
    let cases = forcing.iter().flat_map(|c| [(Format::Hermes, c.clone()), (Format::Generic, c.clone())]).chain([(Format::Generic, (Choice::Auto, true))]);
    for (format, (choice, parallel)) in cases {
        let a = p(json!({"tools": [weather(), clock()], "tool_choice": Value::Null})).unwrap().unwrap();
        let a = Asked { choice: choice.clone(), parallel, ..a };
        let lark = grammar::lark(format, &a).expect("a grammar");
        let g = OutputGrammar::Lark(lark.clone());
        grammars.check(&g).unwrap_or_else(|e| panic!("{lark}\n{e}"));
        let (mut finished, mut replies, mut calls) = (0, 0, 0);
        for seed in 1..=12u64 {
            let mut c = grammars.constraint(&g, &[]).expect("compiles");
            let (mut state, mut ids) = (seed | 1, Vec::new());
            let mut ended = false;
            for _ in 0..400 {
                let mut logits = vec![0.0f32; grammars.vocab()];
                c.mask(&mut logits).expect("mask");
                let allowed: Vec<u32> = (0..logits.len() as u32).filter(|&i| logits[i as usize] == 0.0).collect();
                let t = allowed[(next(&mut state) % allowed.len() as u64) as usize];
                if tok.eos_ids().contains(&t) {
                    ended = true;
                    break;
                }
                c.commit(t).expect("an allowed token commits");
                ids.push(t);
                if c.is_finished() {
                    ended = true;
                    break;
                }
            }
            if !ended {
                continue;
            }
            finished += 1;
            let text = tok.decode(&ids, false).expect("decode");
            let mut sc = Scanner::new(format, a.max_calls());
            let mut pieces = sc.push(&text);
            pieces.extend(sc.finish());
            assert!(!pieces.is_empty(), "{text:?}");
            let reply = pieces.iter().any(|p| matches!(p, Piece::Text(_)));
            if reply {
                // Only `auto` in the generic format may reply, and then only reply.
                assert!(choice == Choice::Auto && pieces.iter().all(|p| matches!(p, Piece::Text(_))), "{format:?} {choice:?}: {pieces:?} in {text:?}");
                replies += 1;
                continue;
            }
            let pieces: Vec<&Piece> = pieces.iter().filter(|p| matches!(p, Piece::Close(_))).collect();
            calls += 1;
            for piece in &pieces {
                let Piece::Close(call) = piece else { unreachable!() };
                let args: Value = serde_json::from_str(&call.arguments).expect("arguments are JSON");
                match call.name.as_str() {
                    "get_weather" => {
                        let city = args["city"].as_str().expect("a city");
                        assert!(city.chars().count() <= 12 && ["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap_or("")), "{args}");
                    }
                    "now" => assert_eq!(args, json!({})),
                    other => panic!("called {other}"),
                }
                if let Choice::Named(n) = &choice {
                    assert_eq!(&call.name, n);
                }
            }
            if a.max_calls() == Some(1) {
                assert_eq!(pieces.len(), 1, "{text:?}");
            }
        }
        assert!(finished >= 6, "{format:?} {choice:?}: only {finished} of 12 walks ended");
        if choice == Choice::Auto {
            assert!(replies > 0 && calls > 0, "{format:?} auto: {replies} replies and {calls} calls in {finished} walks (both are allowed)");
        }
    }
}
