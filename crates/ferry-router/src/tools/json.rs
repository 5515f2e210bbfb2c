//! JSON read as it arrives, for streaming tool calls: where a value ends ([`ValueEnd`]) and a
//! string's characters as they are decoded ([`StrDecoder`]). Both take text in pieces cut
//! anywhere and keep what they need between pieces.

/// Where one JSON value ends. Leading whitespace is part of what it consumes; a number or a
/// literal (`true`, …) ends before the first character that cannot continue it.
#[derive(Clone, Debug, Default)]
pub struct ValueEnd {
    started: bool,
    /// Open objects and arrays.
    depth: u32,
    in_str: bool,
    escape: bool,
    /// The value is a number or a literal.
    bare: bool,
    done: bool,
}

impl ValueEnd {
    /// Reads `text`; `Some(n)`: the value ended after its first `n` bytes (the rest follows it).
    pub fn feed(&mut self, text: &str) -> Option<usize> {
        if self.done {
            return Some(0);
        }
        for (i, c) in text.char_indices() {
            if !self.started {
                if c.is_whitespace() {
                    continue;
                }
                self.started = true;
                match c {
                    '{' | '[' => self.depth = 1,
                    '"' => self.in_str = true,
                    _ => self.bare = true,
                }
                continue;
            }
            if self.bare {
                if !(c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '+')) {
                    self.done = true;
                    return Some(i);
                }
                continue;
            }
            if self.in_str {
                match (self.escape, c) {
                    (true, _) => self.escape = false,
                    (false, '\\') => self.escape = true,
                    (false, '"') => {
                        self.in_str = false;
                        if self.depth == 0 {
                            self.done = true;
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                continue;
            }
            match c {
                '"' => self.in_str = true,
                '{' | '[' => self.depth += 1,
                '}' | ']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        self.done = true;
                        return Some(i + c.len_utf8());
                    }
                }
                _ => {}
            }
        }
        None
    }
}

/// A JSON string's content, decoded as it arrives (after its opening quote): escapes split
/// between pieces, and `\u` surrogate pairs, are held until whole.
#[derive(Clone, Debug, Default)]
pub struct StrDecoder {
    /// An escape begun and not yet complete (from its backslash).
    pending: String,
    /// A high surrogate waiting for its low half.
    high: Option<u16>,
    done: bool,
}

impl StrDecoder {
    /// The characters `text` completes, and `Some(n)` when the closing quote was its byte `n - 1`.
    pub fn feed(&mut self, text: &str) -> (String, Option<usize>) {
        let mut out = String::new();
        if self.done {
            return (out, Some(0));
        }
        for (i, c) in text.char_indices() {
            if !self.pending.is_empty() {
                self.pending.push(c);
                self.escape(&mut out);
                continue;
            }
            match c {
                '\\' => self.pending.push(c),
                '"' => {
                    self.lone_high(&mut out);
                    self.done = true;
                    return (out, Some(i + 1));
                }
                c => {
                    self.lone_high(&mut out);
                    out.push(c);
                }
            }
        }
        (out, None)
    }

    /// Decodes `pending` once it is a whole escape.
    fn escape(&mut self, out: &mut String) {
        let p = self.pending.as_str();
        let simple = match p {
            "\\\"" => Some('"'),
            "\\\\" => Some('\\'),
            "\\/" => Some('/'),
            "\\b" => Some('\u{8}'),
            "\\f" => Some('\u{c}'),
            "\\n" => Some('\n'),
            "\\r" => Some('\r'),
            "\\t" => Some('\t'),
            _ => None,
        };
        if let Some(c) = simple {
            self.lone_high(out);
            out.push(c);
            self.pending.clear();
            return;
        }
        if !p.starts_with("\\u") {
            // Not JSON: kept as written.
            let p = std::mem::take(&mut self.pending);
            self.lone_high(out);
            out.push_str(&p);
            return;
        }
        if p.len() < 6 {
            return;
        }
        let unit = u16::from_str_radix(&p[2..6], 16).ok();
        self.pending.clear();
        match (unit, self.high.take()) {
            (Some(lo @ 0xDC00..=0xDFFF), Some(hi)) => {
                let c = 0x10000 + ((u32::from(hi) - 0xD800) << 10) + (u32::from(lo) - 0xDC00);
                out.push(char::from_u32(c).unwrap_or(char::REPLACEMENT_CHARACTER));
            }
            (Some(hi @ 0xD800..=0xDBFF), prev) => {
                if prev.is_some() {
                    out.push(char::REPLACEMENT_CHARACTER);
                }
                self.high = Some(hi);
            }
            (Some(u), prev) => {
                if prev.is_some() {
                    out.push(char::REPLACEMENT_CHARACTER);
                }
                out.push(char::from_u32(u32::from(u)).unwrap_or(char::REPLACEMENT_CHARACTER));
            }
            (None, prev) => {
                if prev.is_some() {
                    out.push(char::REPLACEMENT_CHARACTER);
                }
                out.push(char::REPLACEMENT_CHARACTER);
            }
        }
    }

    fn lone_high(&mut self, out: &mut String) {
        if self.high.take().is_some() {
            out.push(char::REPLACEMENT_CHARACTER);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `s` cut at every byte boundary pair, and whole.
    fn cuts(s: &str) -> Vec<Vec<&str>> {
        let mut out = vec![vec![s]];
        let b: Vec<usize> = s.char_indices().map(|(i, _)| i).chain([s.len()]).collect();
        for &i in &b {
            for &j in b.iter().filter(|&&j| j >= i) {
                out.push(vec![&s[..i], &s[i..j], &s[j..]]);
            }
        }
        out
    }

    #[test]
    fn value_ends_wherever_the_text_is_cut() {
        for (s, end) in [
            (r#" {"a": [1, "}"], "b": "x\"}"} , "#, 29),
            (r#""a\"b" rest"#, 6),
            ("[1,[2]]]", 7),
            ("12.5e3}", 6),
            ("true,", 4),
        ] {
            for pieces in cuts(s) {
                let mut v = ValueEnd::default();
                let mut at = 0;
                let mut got = None;
                for p in pieces {
                    if let Some(n) = v.feed(p) {
                        got = Some(at + n);
                        break;
                    }
                    at += p.len();
                }
                assert_eq!(got, Some(end), "{s:?}");
            }
        }
        assert_eq!(ValueEnd::default().feed(r#"{"a": "#), None);
    }

    #[test]
    fn strings_decode_wherever_the_text_is_cut() {
        let s = r#"a\"b\\c\n\u00e9\ud83d\ude00 ü\/"tail"#;
        let want = "a\"b\\c\né😀 ü/";
        for pieces in cuts(s) {
            let mut d = StrDecoder::default();
            let (mut text, mut at, mut end) = (String::new(), 0, None);
            for p in pieces {
                let (t, e) = d.feed(p);
                text.push_str(&t);
                if let Some(n) = e {
                    end = Some(at + n);
                    break;
                }
                at += p.len();
            }
            assert_eq!((text.as_str(), end), (want, Some(s.len() - 4)), "{s:?}");
        }
        // The same as serde's reading of the string.
        let serde: String = serde_json::from_str(&format!("\"{}", &s[..s.len() - 4])).unwrap();
        assert_eq!(serde, want);
    }
}
