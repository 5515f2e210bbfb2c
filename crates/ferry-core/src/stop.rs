//! Stop strings over streamed text: text is released only once it cannot be the start of a stop
//! string, and generation ends at the first full match (the stop string itself is not returned).

pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

/// What a push released.
#[derive(Debug, PartialEq, Eq)]
pub struct Released {
    pub text: String,
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self { stops, pending: String::new() }
    }

    pub fn push(&mut self, delta: &str) -> Released {
        self.pending.push_str(delta);
        let first = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min();
        if let Some(at) = first {
            let text = self.pending[..at].to_string();
            self.pending.clear();
            return Released { text, stopped: true };
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut hold = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.pending.ends_with(&s[..i]) {
                    hold = hold.max(i);
                }
            }
        }
        let cut = self.pending.len() - hold;
        let text = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        Released { text, stopped: false }
    }

    /// Releases `delta` unmatched (with whatever was held back): text before stop strings
    /// apply (`min_tokens`).
    pub fn pass(&mut self, delta: &str) -> String {
        self.pending.push_str(delta);
        std::mem::take(&mut self.pending)
    }

    /// Everything still held back (generation ended for another reason).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_across_deltas() {
        let mut m = StopMatcher::new(vec!["\nUser:".into()]);
        assert_eq!(m.push("Hello"), Released { text: "Hello".into(), stopped: false });
        assert_eq!(m.push(" there\nUs"), Released { text: " there".into(), stopped: false });
        assert_eq!(m.push("er: hi"), Released { text: "".into(), stopped: true });
    }

    #[test]
    fn held_text_released_when_it_diverges_or_ends() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("abcE").text, "abc");
        assert_eq!(m.push("Nx").text, "ENx");
        assert_eq!(m.push("E").text, "");
        assert_eq!(m.finish(), "E");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let mut m = StopMatcher::new(vec!["b".into(), "a".into()]);
        assert_eq!(m.push("xyzab"), Released { text: "xyz".into(), stopped: true });
    }

    #[test]
    fn multibyte_prefixes() {
        let mut m = StopMatcher::new(vec!["世界".into()]);
        assert_eq!(m.push("你好世").text, "你好");
        assert_eq!(m.push("界"), Released { text: "".into(), stopped: true });
    }
}
