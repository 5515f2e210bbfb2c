use super::*;

fn call(name: &str, arguments: &str) -> Piece {
    Piece::Close(Call { name: name.into(), arguments: arguments.into() })
}

fn text(t: &str) -> Piece {
    Piece::Text(t.into())
}

/// Pieces with neighbouring texts joined (a stream may split content anywhere), each call
/// checked to open with its name and stream exactly its arguments, then kept as its `Close`.
fn joined(pieces: Vec<Piece>) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::new();
    let mut open: Option<(String, String)> = None;
    for p in pieces {
        match (out.last_mut(), p) {
            (_, Piece::Open(name)) => {
                assert!(open.is_none(), "a call opened inside another");
                open = Some((name, String::new()));
            }
            (_, Piece::Args(a)) => open.as_mut().expect("arguments outside a call").1.push_str(&a),
            (_, Piece::Close(c)) => {
                let (name, args) = open.take().expect("a close without an open");
                assert_eq!((name.as_str(), args.as_str()), (c.name.as_str(), c.arguments.as_str()), "the streamed call is the closed one");
                out.push(Piece::Close(c));
            }
            (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
            (_, p) => out.push(p),
        }
    }
    assert!(open.is_none(), "a call left open");
    out
}

fn whole(s: &str, max: Option<usize>) -> Vec<Piece> {
    let mut sc = Scanner::new(Format::Hermes, max);
    let mut out = sc.push(s);
    out.extend(sc.finish());
    joined(out)
}

/// The text in chunks cut at `cuts` (byte offsets on character boundaries).
fn chunked(s: &str, cuts: &[usize], max: Option<usize>) -> Vec<Piece> {
    let mut sc = Scanner::new(Format::Hermes, max);
    let mut out = Vec::new();
    let mut at = 0;
    for &c in cuts.iter().chain(std::iter::once(&s.len())) {
        out.extend(sc.push(&s[at..c]));
        at = c;
    }
    out.extend(sc.finish());
    joined(out)
}

const CASES: &[(&str, &[(&str, &str)], &str)] = &[
    // (text, calls, content)
    ("Hello there.\n", &[], "Hello there.\n"),
    ("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>", &[("f", "{\"a\": 1}")], ""),
    (
        "Let me look.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"<x>\"}}\n</tool_call>\n<tool_call>{\"arguments\": {}, \"name\": \"g\"}</tool_call>\n",
        &[("f", "{\"a\": \"<x>\"}"), ("g", "{}")],
        "Let me look.",
    ),
    ("a <tool_ b <tool_call>{\"name\": \"f\"}</tool_call> c é", &[("f", "{}")], "a <tool_ b c é"),
    ("<tool_call>not json</tool_call> then", &[], "<tool_call>not json</tool_call> then"),
    ("<tool_call>{\"name\": 3}</tool_call>", &[], "<tool_call>{\"name\": 3}</tool_call>"),
    ("<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"q\\\": 2}\"}</tool_call>", &[("f", "{\"q\": 2}")], ""),
    ("<tool_call>{\"name\": \"f\", \"parameters\": [1]}", &[("f", "[1]")], ""),
    ("x <tool_call>{\"name\": \"f\", \"argu", &[], "x <tool_call>{\"name\": \"f\", \"argu"),
    ("<tool_call>\n{\"nom\": 1}</tool_call>", &[], "<tool_call>\n{\"nom\": 1}</tool_call>"),
    // Cut short inside the arguments: the call closes with what arrived.
    ("<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": [1, ", &[("f", "{\"a\": [1, ")], ""),
    ("ends in a partial tag <tool_c", &[], "ends in a partial tag <tool_c"),
    ("ünï <tool_call>{\"name\": \"ß\", \"arguments\": {\"k\": \"日本\"}}</tool_call>", &[("ß", "{\"k\": \"日本\"}")], "ünï"),
];

fn expected(calls: &[(&str, &str)], content: &str) -> Vec<Piece> {
    // Content before the calls, in these cases (the scanner keeps their order in general).
    let mut want = Vec::new();
    if !content.is_empty() {
        want.push(text(content));
    }
    want.extend(calls.iter().map(|(n, a)| call(n, a)));
    want
}

#[test]
fn whole_texts() {
    for (s, calls, content) in CASES {
        let got = whole(s, None);
        let mut got_calls: Vec<Piece> = got.iter().filter(|p| matches!(p, Piece::Close(_))).cloned().collect();
        let got_text: String = got.iter().filter_map(|p| if let Piece::Text(t) = p { Some(t.as_str()) } else { None }).collect();
        let want = expected(calls, content);
        let want_calls: Vec<Piece> = want.iter().filter(|p| matches!(p, Piece::Close(_))).cloned().collect();
        assert_eq!(got_text, *content, "{s:?}");
        assert_eq!(std::mem::take(&mut got_calls), want_calls, "{s:?}");
    }
}

#[test]
fn every_split_point_gives_the_whole_answer() {
    for (s, _, _) in CASES {
        let want = whole(s, None);
        let bounds: Vec<usize> = (1..s.len()).filter(|&i| s.is_char_boundary(i)).collect();
        for &i in &bounds {
            assert_eq!(chunked(s, &[i], None), want, "{s:?} cut at {i}");
        }
        // One character at a time.
        assert_eq!(chunked(s, &bounds, None), want, "{s:?} char by char");
        // And in threes.
        let threes: Vec<usize> = bounds.iter().copied().step_by(3).collect();
        assert_eq!(chunked(s, &threes, Some(1)), whole(s, Some(1)), "{s:?} in threes");
    }
}

#[test]
fn content_after_a_call_stays_in_order() {
    let s = "A <tool_call>{\"name\": \"f\"}</tool_call>\n\nB\n";
    assert_eq!(whole(s, None), vec![text("A"), call("f", "{}"), text("\n\nB")]);
}

#[test]
fn past_max_calls_calls_are_dropped() {
    let s = "<tool_call>{\"name\": \"f\"}</tool_call>\n<tool_call>{\"name\": \"g\"}</tool_call>";
    assert_eq!(whole(s, Some(1)), vec![call("f", "{}")]);
    assert_eq!(whole(s, None), vec![call("f", "{}"), call("g", "{}")]);
}

#[test]
fn partial_tags() {
    assert_eq!(partial_tag_len("abc<tool", "<tool_call>"), 5);
    assert_eq!(partial_tag_len("abc<", "<tool_call>"), 1);
    assert_eq!(partial_tag_len("abc", "<tool_call>"), 0);
    assert_eq!(partial_tag_len("", "<tool_call>"), 0);
    assert_eq!(partial_tag_len("é", "<tool_call>"), 0);
}

#[test]
fn formats_are_detected_from_templates() {
    assert_eq!(Format::detect("... within <tool_call></tool_call> XML tags ..."), Some(Format::Hermes));
    assert_eq!(Format::detect("{{ messages }}"), None);
    let (head, tail) = Format::Hermes.call_text("get \"w\"");
    assert_eq!(head, "<tool_call>\n{\"name\": \"get \\\"w\\\"\", \"arguments\": ");
    let text = format!("{head}{{\"a\":1}}{tail}");
    assert_eq!(whole(&text, None), vec![call("get \"w\"", "{\"a\":1}")]);
}

fn generic(s: &str, max: Option<usize>, cuts: &[usize]) -> Vec<Piece> {
    let mut sc = Scanner::new(Format::Generic, max);
    let mut out = Vec::new();
    let mut at = 0;
    for &c in cuts.iter().chain(std::iter::once(&s.len())) {
        out.extend(sc.push(&s[at..c]));
        at = c;
    }
    out.extend(sc.finish());
    joined(out)
}

#[test]
fn generic_answers_wherever_the_text_is_cut() {
    let cases: &[(&str, Vec<Piece>)] = &[
        (r#"{"response": "Hi \"you\"\nü \u00e9"}"#, vec![text("Hi \"you\"\nü é")]),
        (
            r#"{"tool_calls": [{"name": "f", "arguments": {"a": "}"}}, {"name": "g", "arguments": {}}]}"#,
            vec![call("f", r#"{"a": "}"}"#), call("g", "{}")],
        ),
        (r#"  { "tool_calls" : [ {"arguments": {"b": 2}, "name": "h"} ] }"#, vec![call("h", r#"{"b": 2}"#)]),
        ("Just text, no JSON.", vec![text("Just text, no JSON.")]),
        (r#"{"other": 1}"#, vec![text(r#"{"other": 1}"#)]),
        // Cut short: the reply so far; a call with the arguments that arrived.
        (r#"{"response": "Hel"#, vec![text("Hel")]),
        (r#"{"tool_calls": [{"name": "f", "arguments": {"a": 1"#, vec![call("f", r#"{"a": 1"#)]),
    ];
    for (s, want) in cases {
        assert_eq!(&generic(s, None, &[]), want, "{s:?}");
        let bounds: Vec<usize> = (1..s.len()).filter(|&i| s.is_char_boundary(i)).collect();
        for &i in &bounds {
            assert_eq!(&generic(s, None, &[i]), want, "{s:?} cut at {i}");
        }
        assert_eq!(&generic(s, None, &bounds), want, "{s:?} char by char");
    }
    let two = r#"{"tool_calls": [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]}"#;
    assert_eq!(generic(two, Some(1), &[]), vec![call("f", "{}")]);
}

#[test]
fn arguments_stream_before_the_call_closes() {
    let mut sc = Scanner::new(Format::Hermes, None);
    let first = sc.push("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par");
    assert_eq!(first, vec![Piece::Open("get_weather".into()), Piece::Args("{\"city\": \"Par".into())]);
    assert_eq!(sc.push("is\"}}\n</tool_call>"), vec![Piece::Args("is\"}".into()), call("get_weather", "{\"city\": \"Paris\"}")]);
    let mut sc = Scanner::new(Format::Generic, None);
    assert_eq!(sc.push("{\"response\": \"Hel"), vec![text("Hel")]);
    assert_eq!(sc.push("lo\"}"), vec![text("lo")]);
}
