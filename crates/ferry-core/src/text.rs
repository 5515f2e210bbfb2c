//! Bounding text that goes back to a client (error messages, echoed values): one rule for where
//! a cut falls and how it shows.

use std::borrow::Cow;

/// `s` cut to `max` characters (never inside one), `…` marking the cut.
pub fn clip(s: &str, max: usize) -> Cow<'_, str> {
    match s.char_indices().nth(max) {
        None => Cow::Borrowed(s),
        Some((i, _)) => Cow::Owned(format!("{}…", &s[..i])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_at_a_character_and_marks_the_cut() {
        assert_eq!(clip("short", 10), "short");
        assert_eq!(clip("exactly", 7), "exactly");
        assert_eq!(clip("éééé", 2), "éé…");
        assert!(matches!(clip("abc", 3), Cow::Borrowed(_)));
    }
}
