//! What a client may read of llguidance's errors: the first line, bounded, and nothing that
//! looks like a panic, a backtrace, a source path or the parser's internal state.

/// The longest message kept, in characters.
pub const MAX_MESSAGE_CHARS: usize = 300;

/// Markers of text a client must not see (a panic's message and backtrace, build paths,
/// llguidance's state dumps).
const INTERNAL: &[&str] = &["panic", "backtrace", "RUST_BACKTRACE", "src/", ".rs:", "<state>", "/home/", "/.cargo/", "/rustc/"];

/// `raw` cut to its first line and [`MAX_MESSAGE_CHARS`]; a message that shows internals is
/// replaced as a whole by `fallback`.
pub fn clean(raw: &str, fallback: &str) -> String {
    let first = raw.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("");
    if first.is_empty() || INTERNAL.iter().any(|m| first.to_ascii_lowercase().contains(&m.to_ascii_lowercase())) {
        return fallback.to_owned();
    }
    ferry_core::text::clip(first, MAX_MESSAGE_CHARS).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_bounded_first_line_is_kept() {
        assert_eq!(clean("bad rule r2\n<state>\nitems: 12", "x"), "bad rule r2");
        assert_eq!(clean("\n  \n  unknown name: foo  \nmore", "x"), "unknown name: foo");
        let long = "é".repeat(1000);
        let c = clean(&long, "x");
        assert_eq!(c.chars().count(), MAX_MESSAGE_CHARS + 1);
        assert!(c.ends_with('…'));
    }

    #[test]
    fn internals_are_replaced() {
        for raw in [
            "panic: index out of bounds\n<backtrace>\n  0: std::backtrace\n</backtrace>",
            "thread 'x' panicked at /home/u/.cargo/registry/src/llguidance-1.9.1/src/earley/parser.rs:10:5",
            "failed at src/earley/lexer.rs:12",
            "",
        ] {
            assert_eq!(clean(raw, "the grammar engine failed"), "the grammar engine failed", "{raw}");
        }
    }
}
