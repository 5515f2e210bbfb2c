//! A multi-turn chat workload (what prefix caching is for) and the oracle it is scored against.
//!
//! `users` conversations share one system prompt. Conversation `c` starts at a Poisson arrival;
//! its turn 1 is the system prompt plus a user message; turn `t + 1` is turn `t`'s prompt, the
//! answer the server streamed for it, and a new user message, sent a think time after the answer
//! ended. So every prompt after the first turn repeats the previous one and its answer: an
//! unbounded cache serves all of that, and only the new message needs computing.
//!
//! [`PrefixOracle`] is that unbounded cache at block granularity: it records the KV each request
//! leaves behind (its prompt and its answer but the last token, which is never fed back) and
//! says how many leading tokens of a prompt it could serve (whole blocks only, and never the
//! whole prompt: the last token is always computed, for its logits). Pure: randomness comes in
//! as uniforms, answers come in from the caller.

use crate::loadgen::{poisson_arrivals, LenDist};
use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};

/// The shape of the workload.
#[derive(Clone, Debug, PartialEq)]
pub struct MultiturnSpec {
    pub users: usize,
    pub turns: usize,
    /// Tokens of the shared system prompt.
    pub system_tokens: usize,
    /// Tokens of each user message.
    pub user_tokens: LenDist,
    /// Tokens of each answer (`max_tokens`, EOS ignored).
    pub answer_tokens: LenDist,
    /// Mean seconds between an answer's end and the next turn (exponential; 0: none).
    pub think_s: f64,
    /// Conversations started per second (Poisson).
    pub start_rate: f64,
    /// Ids are drawn from `256..vocab` (the low ids of byte-level vocabularies are special).
    pub vocab: u32,
}

/// One user turn: the new message and how long to wait before sending it.
#[derive(Clone, Debug, PartialEq)]
pub struct Turn {
    pub message: Vec<u32>,
    pub max_tokens: usize,
    /// Seconds after the previous answer ended (0 for the first turn).
    pub think_s: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Conversation {
    /// Seconds after the run's start at which turn 1 is sent.
    pub start_s: f64,
    pub turns: Vec<Turn>,
}

/// The shared system prompt and every conversation, all drawn from `uniform`.
pub fn conversations(spec: &MultiturnSpec, uniform: &mut dyn FnMut() -> f64) -> (Vec<u32>, Vec<Conversation>) {
    let span = spec.vocab.saturating_sub(256).max(1) as f64;
    let ids = |n: usize, u: &mut dyn FnMut() -> f64| -> Vec<u32> { (0..n).map(|_| 256 + ((u() * span) as u32).min(span as u32 - 1)).collect() };
    let system = ids(spec.system_tokens, uniform);
    let starts = poisson_arrivals(spec.start_rate.max(f64::MIN_POSITIVE), spec.users, uniform);
    let convs = starts
        .into_iter()
        .map(|start_s| {
            let turns = (0..spec.turns)
                .map(|t| {
                    let n = spec.user_tokens.sample(uniform);
                    let message = ids(n, uniform);
                    let max_tokens = spec.answer_tokens.sample(uniform);
                    let think_s = if t == 0 || spec.think_s <= 0.0 { 0.0 } else { -(1.0 - uniform()).ln() * spec.think_s };
                    Turn { message, max_tokens, think_s }
                })
                .collect();
            Conversation { start_s, turns }
        })
        .collect();
    (system, convs)
}

/// Turn `t`'s prompt (from 0): the previous prompt and answer, then the new message. `history`
/// is the previous prompt and its answer (empty for the first turn, which starts with `system`).
pub fn next_prompt(system: &[u32], history: &[u32], message: &[u32]) -> Vec<u32> {
    let base = if history.is_empty() { system } else { history };
    base.iter().chain(message).copied().collect()
}

/// An unbounded prefix cache of whole blocks: which prefixes some earlier request left KV for.
#[derive(Clone, Debug)]
pub struct PrefixOracle {
    block_size: usize,
    /// The hash of each whole-block prefix seen.
    prefixes: HashSet<u64>,
}

impl PrefixOracle {
    pub fn new(block_size: usize) -> Self {
        PrefixOracle { block_size: block_size.max(1), prefixes: HashSet::new() }
    }

    fn chain<'a>(&self, tokens: &'a [u32]) -> impl Iterator<Item = u64> + 'a {
        let mut h = DefaultHasher::new();
        tokens.chunks_exact(self.block_size).map(move |b| {
            b.hash(&mut h);
            h.finish()
        })
    }

    /// A request finished: `prompt` and `answer` (its last token never had KV computed).
    pub fn record(&mut self, prompt: &[u32], answer: &[u32]) {
        let fed: Vec<u32> = prompt.iter().chain(answer.iter().take(answer.len().saturating_sub(1))).copied().collect();
        let hs: Vec<u64> = self.chain(&fed).collect();
        self.prefixes.extend(hs);
    }

    /// Leading tokens of `prompt` an unbounded cache could serve now: whole blocks, and at most
    /// `prompt.len() - 1` tokens.
    pub fn hit(&self, prompt: &[u32]) -> usize {
        let usable = prompt.len().saturating_sub(1) / self.block_size;
        self.chain(prompt).take(usable).take_while(|h| self.prefixes.contains(h)).count() * self.block_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loadgen::uniforms;

    fn spec() -> MultiturnSpec {
        MultiturnSpec { users: 3, turns: 4, system_tokens: 40, user_tokens: LenDist::Uniform(5, 9), answer_tokens: LenDist::Fixed(6), think_s: 2.0, start_rate: 1.0, vocab: 1000 }
    }

    #[test]
    fn the_workload_is_seeded_and_shaped_as_asked() {
        let (sys, convs) = conversations(&spec(), &mut uniforms(1));
        assert_eq!(conversations(&spec(), &mut uniforms(1)), (sys.clone(), convs.clone()), "same seed, same workload");
        assert_ne!(conversations(&spec(), &mut uniforms(2)).1, convs);
        assert_eq!((sys.len(), convs.len()), (40, 3));
        assert!(sys.iter().all(|&i| (256..1000).contains(&i)));
        for c in &convs {
            assert_eq!(c.turns.len(), 4);
            assert_eq!(c.turns[0].think_s, 0.0);
            assert!(c.turns.iter().all(|t| (5..=9).contains(&t.message.len()) && t.max_tokens == 6 && t.think_s >= 0.0));
        }
        assert!(convs.windows(2).all(|w| w[0].start_s < w[1].start_s));
    }

    #[test]
    fn each_turn_extends_the_last_prompt_and_its_answer() {
        let sys = vec![1, 2, 3];
        let p1 = next_prompt(&sys, &[], &[9]);
        assert_eq!(p1, [1, 2, 3, 9]);
        let history: Vec<u32> = p1.iter().chain(&[7, 7]).copied().collect();
        assert_eq!(next_prompt(&sys, &history, &[8]), [1, 2, 3, 9, 7, 7, 8]);
    }

    #[test]
    fn the_oracle_serves_whole_blocks_of_what_earlier_requests_left() {
        let mut o = PrefixOracle::new(4);
        let sys: Vec<u32> = (0..10).collect();
        let p1 = next_prompt(&sys, &[], &[50, 51]);
        assert_eq!(o.hit(&p1), 0, "nothing seen yet");
        o.record(&p1, &[60, 61, 62]);
        // Another user: shares the system prompt's 2 whole blocks (8 of its 10 tokens).
        assert_eq!(o.hit(&next_prompt(&sys, &[], &[70])), 8);
        // The same user's next turn: prompt (12) + answer but its last token (2) = 14 fed,
        // 3 whole blocks = 12 tokens.
        let history: Vec<u32> = p1.iter().chain(&[60, 61, 62]).copied().collect();
        let p2 = next_prompt(&sys, &history, &[80, 81, 82, 83]);
        assert_eq!(o.hit(&p2), 12);
        // Never the whole prompt: an exact repeat of 12 tokens serves 8 (the last is computed).
        assert_eq!(o.hit(&p1), 8);
        assert_eq!(o.hit(&[]), 0);
        // A different first block shares nothing, even if later blocks match.
        let mut other = p1.clone();
        other[0] = 99;
        assert_eq!(o.hit(&other), 0);
    }
}
