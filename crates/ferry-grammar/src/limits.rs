//! Limits a request's grammar must fit before anything compiles it: cheap scans over its text
//! (size, Lark rule count, nesting depth, choices, regex repetition) that refuse the grammars
//! whose compilation would take seconds or overflow a stack (issue 32: a 1000-rule Lark chain
//! killed the router; 100,000 choices cost a minute of CPU).
//!
//! Pure functions over the grammar; the compile itself then runs under llguidance's own
//! [`ParserLimits`] (lexer fuel, Earley items, grammar size), set from the same [`Limits`].
//! These scans are deliberately conservative approximations: a grammar that passes them is
//! still compiled in full (and its first mask computed), so router and worker agree.

use ferry_core::sampling::OutputGrammar;
use llguidance::api::ParserLimits;
use serde_json::Value;

use crate::{GrammarError, GrammarKind};

/// Every limit on a request's grammar. [`Limits::default`] is what `ferry` serves with.
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    /// Bytes of a JSON schema's, regex's or Lark grammar's text.
    pub max_text_bytes: usize,
    /// Definitions (rules and terminals) in a Lark grammar.
    pub max_lark_rules: usize,
    /// Nesting depth: brackets of a JSON schema document, groups of a regex or Lark grammar.
    pub max_nesting: usize,
    /// Strings in a choice list.
    pub max_choices: usize,
    /// Bytes of all choices together.
    pub max_choice_bytes: usize,
    /// A regex's repetition counts multiplied along their nesting (`a{1000}{1000}`: 1,000,000).
    pub max_repetition: u64,
    /// llguidance: symbols in the compiled grammar's productions.
    pub max_grammar_size: usize,
    /// llguidance: lexer fuel to build the grammar's regexes (about 50 per microsecond).
    pub initial_lexer_fuel: u64,
    /// llguidance: lexer fuel for one token mask (about 14 per microsecond).
    pub step_lexer_fuel: u64,
    /// llguidance: Earley items for one token mask.
    pub step_max_items: usize,
    /// llguidance: lexer states (memory: 1-2 kB each).
    pub max_lexer_states: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_text_bytes: 64 * 1024,
            max_lark_rules: 512,
            max_nesting: 64,
            max_choices: 1024,
            max_choice_bytes: 64 * 1024,
            max_repetition: 10_000,
            max_grammar_size: 200_000,
            initial_lexer_fuel: 1_000_000,
            step_lexer_fuel: 200_000,
            step_max_items: 50_000,
            max_lexer_states: 100_000,
        }
    }
}

impl Limits {
    /// llguidance's limits for a compile under these; errors come without the parser's state.
    pub fn parser_limits(&self) -> ParserLimits {
        ParserLimits {
            max_grammar_size: self.max_grammar_size,
            initial_lexer_fuel: self.initial_lexer_fuel,
            step_lexer_fuel: self.step_lexer_fuel,
            step_max_items: self.step_max_items,
            max_lexer_states: self.max_lexer_states,
            verbose_errors: false,
            ..ParserLimits::default()
        }
    }
}

/// Refuses `g` if it exceeds any of `limits`' text limits.
pub fn check(g: &OutputGrammar, limits: &Limits) -> Result<(), GrammarError> {
    let kind = GrammarKind::of(g);
    let over = |what: &'static str, value: u64, max: u64| -> Result<(), GrammarError> {
        if value > max { Err(GrammarError::Limit { kind, what, value, max }) } else { Ok(()) }
    };
    let text_size = |t: &str| over("its size in bytes", t.len() as u64, limits.max_text_bytes as u64);
    let nesting = |d: usize| over("its nesting depth", d as u64, limits.max_nesting as u64);
    match g {
        OutputGrammar::JsonObject => Ok(()),
        OutputGrammar::JsonSchema(text) => {
            text_size(text)?;
            // serde_json refuses documents nested deeper than 128 before this sees them.
            let Ok(v) = serde_json::from_str::<Value>(text) else { return Ok(()) };
            nesting(json_depth(&v))?;
            for rx in json_patterns(&v) {
                nesting(regex_depth(rx))?;
                over("a pattern's repetition count", regex_repetition(rx), limits.max_repetition)?;
            }
            match crate::finite::no_finite_instance(&v) {
                Some(message) => Err(GrammarError::Invalid { kind, message }),
                None => Ok(()),
            }
        }
        OutputGrammar::Regex(rx) => {
            text_size(rx)?;
            nesting(regex_depth(rx))?;
            over("its repetition count", regex_repetition(rx), limits.max_repetition)
        }
        OutputGrammar::Lark(src) => {
            text_size(src)?;
            over("its number of rules", lark_rules(src) as u64, limits.max_lark_rules as u64)?;
            nesting(lark_depth(src))?;
            over("a regex's repetition count", lark_repetition(src), limits.max_repetition)
        }
        OutputGrammar::Choice(choices) => {
            over("its number of choices", choices.len() as u64, limits.max_choices as u64)?;
            over("its total size in bytes", choices.iter().map(|c| c.len() as u64).sum(), limits.max_choice_bytes as u64)
        }
    }
}

/// The deepest nesting of arrays and objects in `v` (a scalar: 0).
fn json_depth(v: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(v, 0usize)];
    while let Some((v, d)) = stack.pop() {
        deepest = deepest.max(d);
        match v {
            Value::Array(a) => stack.extend(a.iter().map(|x| (x, d + 1))),
            Value::Object(o) => stack.extend(o.values().map(|x| (x, d + 1))),
            _ => {}
        }
    }
    deepest
}

/// The regexes a JSON schema holds: `pattern` values and `patternProperties` keys.
fn json_patterns(v: &Value) -> Vec<&str> {
    let mut out = Vec::new();
    for_each_member(v, |k, x| match (k, x) {
        ("pattern", Value::String(s)) => out.push(s.as_str()),
        ("patternProperties", Value::Object(p)) => out.extend(p.keys().map(String::as_str)),
        _ => {}
    });
    out
}

/// Calls `f` with every member (key and value) of every object in the JSON document `v`.
pub(crate) fn for_each_member<'a>(v: &'a Value, mut f: impl FnMut(&'a str, &'a Value)) {
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        match v {
            Value::Array(a) => stack.extend(a),
            Value::Object(o) => {
                for (k, x) in o {
                    f(k.as_str(), x);
                    stack.push(x);
                }
            }
            _ => {}
        }
    }
}

/// The deepest nesting of groups `(...)` in a regex (escapes and classes skipped).
fn regex_depth(rx: &str) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    for t in regex_tokens(rx) {
        match t {
            Tok::Open => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            Tok::Close => depth = depth.saturating_sub(1),
            Tok::Atom | Tok::Repeat(_) => {}
        }
    }
    deepest
}

/// The largest product of repetition counts applying to one atom: `a{1000}{1000}` is
/// 1,000,000, `(a{10}){20}` is 200, `x*` is 1 (an unbounded star adds no states).
fn regex_repetition(rx: &str) -> u64 {
    // Per open group: the largest product inside it so far, and that of its last item.
    let mut groups: Vec<(u64, u64)> = vec![(1, 1)];
    let mut last: u64 = 1;
    let mut worst: u64 = 1;
    for t in regex_tokens(rx) {
        match t {
            Tok::Atom => last = 1,
            Tok::Open => groups.push((1, 1)),
            Tok::Close => {
                if groups.len() > 1 {
                    let (inner, _) = groups.pop().unwrap_or((1, 1));
                    last = inner;
                }
            }
            Tok::Repeat(n) => last = last.saturating_mul(n.max(1)),
        }
        worst = worst.max(last);
        if let Some(g) = groups.last_mut() {
            g.0 = g.0.max(last);
        }
    }
    worst
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Tok {
    Atom,
    Open,
    Close,
    /// `{n}`, `{n,}`, `{n,m}`: the larger count (an unparsable count: `u64::MAX`).
    Repeat(u64),
}

/// A regex as the tokens that matter here: escapes and character classes are atoms.
fn regex_tokens(rx: &str) -> Vec<Tok> {
    let b = rx.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' => {
                out.push(Tok::Atom);
                i += 2;
                continue;
            }
            b'[' => {
                // A class ends at the first `]` that is not its first member or escaped.
                i += 1;
                if b.get(i) == Some(&b'^') {
                    i += 1;
                }
                if b.get(i) == Some(&b']') {
                    i += 1;
                }
                while i < b.len() && b[i] != b']' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                out.push(Tok::Atom);
            }
            b'(' => out.push(Tok::Open),
            b')' => out.push(Tok::Close),
            b'{' => {
                let end = b[i..].iter().position(|&c| c == b'}').map(|p| i + p);
                let body = end.map(|e| &rx[i + 1..e]);
                match body.filter(|s| !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit() || c == b',' || c == b' ')) {
                    Some(s) => {
                        let n = s.split(',').filter_map(|p| p.trim().parse::<u64>().ok().or_else(|| (!p.trim().is_empty()).then_some(u64::MAX))).max();
                        out.push(Tok::Repeat(n.unwrap_or(1)));
                        i = end.unwrap_or(i);
                    }
                    None => out.push(Tok::Atom),
                }
            }
            _ => out.push(Tok::Atom),
        }
        i += 1;
    }
    out
}

/// Definitions in a Lark grammar: lines that start with a name (optionally `?`/`!`, a
/// `.priority`) and a colon.
fn lark_rules(src: &str) -> usize {
    src.lines()
        .filter(|l| {
            let l = l.trim_start().trim_start_matches(['?', '!']);
            let name_end = l.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-')).unwrap_or(l.len());
            name_end > 0 && l[name_end..].trim_start().starts_with(':') && !l.starts_with(|c: char| c.is_ascii_digit())
        })
        .count()
}

/// The deepest nesting of `(`, `[` and `{` in a Lark grammar outside its string literals and
/// comments (regex literals count: their groups nest too).
fn lark_depth(src: &str) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    for (text, is_code) in lark_parts(src) {
        if !is_code {
            continue;
        }
        for c in text.chars() {
            match c {
                '(' | '[' | '{' => {
                    depth += 1;
                    deepest = deepest.max(depth);
                }
                ')' | ']' | '}' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
    }
    deepest
}

/// The worst repetition in a Lark grammar's `/regex/` literals.
fn lark_repetition(src: &str) -> u64 {
    let mut worst = 1;
    for (text, is_code) in lark_parts(src) {
        if !is_code {
            continue;
        }
        // Regex literals: `/.../` after a colon, a `|`, a space or a bracket.
        let mut rest = text;
        while let Some(start) = rest.find('/') {
            let after = &rest[start + 1..];
            let Some(len) = after.find('/') else { break };
            worst = worst.max(regex_repetition(&after[..len]));
            rest = &after[len + 1..];
        }
    }
    worst
}

/// A Lark grammar cut into string literals (`"..."`, not code) and the rest (code), comments
/// (`//` to the end of a line) dropped.
fn lark_parts(src: &str) -> Vec<(&str, bool)> {
    let mut out = Vec::new();
    let b = src.as_bytes();
    let (mut i, mut from) = (0, 0);
    while i < b.len() {
        if b[i] == b'"' {
            out.push((&src[from..i], true));
            let start = i;
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(b.len());
            out.push((&src[start..i], false));
            from = i;
        } else if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            out.push((&src[from..i], true));
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            from = i;
        } else {
            i += 1;
        }
    }
    out.push((&src[from..], true));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repetition_multiplies_along_nesting() {
        for (rx, n) in [
            ("a{1000}{1000}", 1_000_000),
            ("(a{10}){20}", 200),
            ("[0-9]{3}-(ab|cd)", 3),
            ("a*b+c?", 1),
            ("x{2,5}", 5),
            ("x{7,}", 7),
            (r"\{1000\}", 1),
            ("[{]1000}", 1),
            ("(a{3}|b{40})", 40),
            ("((a{10}){10}){10}", 1000),
            ("a{99999999999999999999999}", u64::MAX),
        ] {
            assert_eq!(regex_repetition(rx), n, "{rx}");
        }
    }

    #[test]
    fn depth_and_rules_are_counted() {
        assert_eq!(regex_depth("((a)(b(c)))"), 3);
        assert_eq!(regex_depth(r"\(\(["), 0);
        assert_eq!(lark_rules("start: r1\nr1: \"x\" | r2\n  | r3\n?r2.2: \"y\"\nNUM: /[0-9]/\n// c: d\n"), 4);
        assert_eq!(lark_depth("start: ((\"(((\" x))) // (((((\n"), 2);
        assert_eq!(lark_repetition("start: /a{100}{100}/ | \"/a{9999}{9}/\""), 10_000);
        assert_eq!(json_depth(&serde_json::json!({"a": [{"b": 1}]})), 3);
    }
}
