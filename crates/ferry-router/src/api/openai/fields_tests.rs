use serde_json::json;

use super::*;
use crate::api::openai::request::parse;

fn parse_with(kind: Kind, extra: &str) -> Result<(), ApiError> {
    let base = match kind {
        Kind::Completion => r#""model": "m", "prompt": "Hi""#,
        Kind::Chat => r#""model": "m", "messages": [{"role": "user", "content": "Hi"}]"#,
    };
    parse(kind, format!("{{{base}, {extra}}}").as_bytes()).map(|_| ())
}

#[test]
fn each_limited_or_rejected_field_takes_its_defaults_and_refuses_the_rest() {
    use Kind::{Chat as C, Completion as P};
    // (endpoint, field, accepted values, refused values)
    let cases: &[(Kind, &str, &[Value], &[Value])] = &[
        (P, "user", &[json!("u-17"), json!(null)], &[json!(5)]),
        (P, "frequency_penalty", &[json!(0), json!(0.5), json!(-2), json!(null)], &[json!(2.5), json!("0")]),
        (C, "presence_penalty", &[json!(0), json!(-1.5)], &[json!(-2.01)]),
        (C, "logit_bias", &[json!({}), json!(null), json!({"50256": -100})], &[json!({"50256": -101}), json!({"x": 1})]),
        (P, "n", &[json!(1), json!(null), json!(16)], &[json!(17), json!(0), json!("1")]),
        (C, "n", &[json!(2)], &[json!(-1)]),
        (P, "suffix", &[json!(""), json!(null)], &[json!(" end")]),
        (P, "best_of", &[json!(1)], &[json!(3)]),
        (C, "metadata", &[json!({"team": "a"}), json!({})], &[json!({"n": 1}), json!("x")]),
        (C, "safety_identifier", &[json!("h-1")], &[json!(["x"])]),
        (C, "prompt_cache_key", &[json!("conv-9")], &[json!(9)]),
        (C, "prompt_cache_retention", &[json!("in_memory")], &[json!("24h")]),
        (C, "prompt_cache_options", &[json!({}), json!({"mode": "implicit"})], &[json!({"mode": "explicit"}), json!({"ttl": "30m"})]),
        (C, "service_tier", &[json!("auto"), json!("default")], &[json!("flex"), json!("priority")]),
        (C, "store", &[json!(false)], &[json!(true)]),
        (C, "modalities", &[json!(["text"])], &[json!(["text", "audio"]), json!([])]),
        (C, "verbosity", &[json!("medium")], &[json!("low")]),
        (C, "reasoning_effort", &[json!("none")], &[json!("high")]),
        (C, "audio", &[json!(null)], &[json!({"voice": "alloy", "format": "wav"})]),
        (C, "moderation", &[json!(null)], &[json!({"model": "omni-moderation-latest"})]),
        (C, "prediction", &[json!(null)], &[json!({"type": "content", "content": "x"})]),
        (C, "web_search_options", &[json!(null)], &[json!({})]),
        (C, "functions", &[json!([])], &[json!([{"name": "f"}])]),
        (C, "function_call", &[json!("none")], &[json!("auto")]),
        (P, "min_p", &[json!(0), json!(0.1), json!(1)], &[json!(1.1), json!(-0.1)]),
        (C, "repetition_penalty", &[json!(1), json!(1.0), json!(1.1), json!(0.5)], &[json!(0), json!(-1)]),
        (P, "min_tokens", &[json!(0), json!(16), json!(null)], &[json!(129), json!(-1)]),
        (C, "bad_words", &[json!("no"), json!(["a", "b c"]), json!([])], &[json!([""]), json!([3]), json!(7)]),
        (C, "guided_decoding_backend", &[json!("llguidance"), json!("auto"), json!(null)], &[json!("xgrammar"), json!(3)]),
        (P, "guided_whitespace_pattern", &[json!(null)], &[json!(" ")]),
    ];
    for (kind, name, good, bad) in cases {
        for v in *good {
            parse_with(*kind, &format!("\"{name}\": {v}"))
                .unwrap_or_else(|e| panic!("{kind:?} {name} = {v} was refused: {e:?}"));
        }
        for v in *bad {
            let e = parse_with(*kind, &format!("\"{name}\": {v}")).expect_err(&format!("{name} = {v}"));
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(*name)), "{e:?}");
            assert!(e.message.contains(&format!("`{name}`")), "{}", e.message);
        }
    }
    // Every limited or rejected field is exercised above (and the supported fields with ranges).
    // (The responses fields have their cases in `responses::parse`'s tests.)
    for f in FIELDS.iter().filter(|f| f.on != On::Responses) {
        if !matches!(f.support, Support::Supported) {
            assert!(cases.iter().any(|c| c.1 == f.name), "no case for {}", f.name);
        }
    }
}

#[test]
fn unknown_fields_are_named() {
    for (kind, extra, param) in [
        (Kind::Completion, r#""frobnicate": true"#, "frobnicate"),
        (Kind::Chat, r#""prompt": "x""#, "prompt"),
        (Kind::Completion, r#""max_completion_tokens": 3"#, "max_completion_tokens"),
        (Kind::Completion, r#""tools": []"#, "tools"),
        (Kind::Chat, r#""suffix": """#, "suffix"),
    ] {
        let e = parse_with(kind, extra).expect_err(extra);
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{e:?}");
        assert_eq!(e.message, format!("unknown field \"{param}\""));
    }
}

#[test]
fn a_refused_value_is_shown_cut_short() {
    let e = parse_with(Kind::Chat, &format!(r#""functions": [{{"d": "{}"}}]"#, "x".repeat(500))).unwrap_err();
    assert!(e.message.len() < 200 && e.message.contains('…'), "{}", e.message);
}

#[test]
fn names_are_unique_per_endpoint() {
    for table in [FIELDS, MESSAGE_FIELDS, STREAM_OPTIONS] {
        for kind in [Endpoint::Chat, Endpoint::Completions, Endpoint::Responses] {
            let mut names: Vec<&str> = table.iter().filter(|f| f.on.takes(kind)).map(|f| f.name).collect();
            names.sort_unstable();
            let n = names.len();
            names.dedup();
            assert_eq!(n, names.len(), "a field listed twice for {kind:?}");
        }
    }
}

/// docs/api.md's request-field table: `(field, endpoints, class)` per row.
fn documented() -> Vec<(String, String, String)> {
    let doc = include_str!("../../../../../docs/api.md");
    let start = doc.find("<!-- fields -->").expect("docs/api.md marks its field table with <!-- fields -->");
    doc[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|l| {
            let cells: Vec<String> = l.split('|').map(|c| c.trim().to_owned()).collect();
            (cells[1].trim_matches('`').to_owned(), cells[2].clone(), cells[3].clone())
        })
        .collect()
}

#[test]
fn docs_api_md_has_the_same_table() {
    let docs = documented();
    let on = |o: On| match o {
        On::Both => "both",
        On::Chat => "chat",
        On::Completions => "completions",
        On::Responses => "responses",
    };
    let mut want: Vec<(String, String, String)> = FIELDS
        .iter()
        .map(|f| (f.name.to_owned(), on(f.on).to_owned(), f.support.class().to_owned()))
        .chain(MESSAGE_FIELDS.iter().map(|f| (format!("messages[].{}", f.name), "chat".into(), f.support.class().into())))
        .chain(STREAM_OPTIONS.iter().map(|f| (format!("stream_options.{}", f.name), "both".into(), f.support.class().into())))
        .collect();
    let mut got = docs.clone();
    want.sort();
    got.sort();
    for w in &want {
        assert!(got.contains(w), "docs/api.md's field table lacks or differs on {w:?}");
    }
    for g in &got {
        assert!(want.contains(g), "docs/api.md's field table has {g:?}, which fields.rs does not");
    }
}
