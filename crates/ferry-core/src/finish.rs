//! Why a sequence stops: the one rule every sampling loop asks after each token (the engine's
//! own `generate`, the worker's batch step and a request joining the batch), pure.

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// Reached max_tokens.
    Length,
    /// Emitted a stop token (EOS or a requested id).
    StopToken(u32),
    /// The text reached a stop string.
    StopString,
    /// The sequence filled the model's context.
    ContextFull,
}

/// The bounds a sequence runs within.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds<'a> {
    /// Ids that end the sequence (EOS, `stop_token_ids`); not counted as output.
    pub stop_ids: &'a [u32],
    pub max_tokens: usize,
    pub prompt_tokens: usize,
    /// The model's context (`max_position`).
    pub context: usize,
}

/// What happened with the token just sampled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct After {
    pub token: u32,
    /// Output tokens, counting this one unless it is a stop id.
    pub count: usize,
    /// The answer's grammar is complete: only an end of sequence could follow, so the sequence
    /// stops without spending a step on it.
    pub grammar_done: bool,
    /// The text reached a stop string.
    pub stop_string: bool,
}

impl Bounds<'_> {
    /// Whether `token` is one of the stop ids (checked before the token is counted or sent).
    pub fn stops(&self, token: u32) -> Option<FinishReason> {
        self.stop_ids.contains(&token).then_some(FinishReason::StopToken(token))
    }

    /// The finish after a token the sequence kept, in this order: a stop string, a complete
    /// grammar (as the first stop id, or the token itself when there is none), `max_tokens`,
    /// the context.
    pub fn after(&self, a: After) -> Option<FinishReason> {
        if a.stop_string {
            Some(FinishReason::StopString)
        } else if a.grammar_done {
            Some(FinishReason::StopToken(self.stop_ids.first().copied().unwrap_or(a.token)))
        } else if a.count >= self.max_tokens {
            Some(FinishReason::Length)
        } else if self.prompt_tokens + a.count >= self.context {
            Some(FinishReason::ContextFull)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_in_order() {
        let b = Bounds { stop_ids: &[2, 9], max_tokens: 4, prompt_tokens: 10, context: 13 };
        let kept = |count, grammar_done, stop_string| b.after(After { token: 5, count, grammar_done, stop_string });
        assert_eq!(b.stops(9), Some(FinishReason::StopToken(9)));
        assert_eq!(b.stops(5), None);
        assert_eq!(kept(1, false, false), None);
        assert_eq!(kept(2, false, false), None);
        assert_eq!(kept(3, false, false), Some(FinishReason::ContextFull));
        assert_eq!(kept(4, false, false), Some(FinishReason::Length), "max_tokens before the context");
        assert_eq!(kept(4, true, false), Some(FinishReason::StopToken(2)), "a complete grammar ends as the first stop id");
        assert_eq!(kept(4, true, true), Some(FinishReason::StopString), "a stop string first");
        let none = Bounds { stop_ids: &[], ..b };
        assert_eq!(none.after(After { token: 5, count: 1, grammar_done: true, stop_string: false }), Some(FinishReason::StopToken(5)));
    }
}
