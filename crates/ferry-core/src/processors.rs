//! vLLM's logits processors: what a request's penalties, bias, `min_tokens` and bad words do to
//! the model's logits before the sampler sees them (temperature, `min_p`, top-k and top-p are
//! the sampler's).
//!
//! Applied in vLLM's order: bad words and `min_tokens` (banned tokens become -inf), logit bias
//! (added), then the penalties: repetition (HF's `RepetitionPenaltyLogitsProcessor`: a positive
//! logit divided by the penalty, a negative one multiplied, for every token of the prompt or the
//! output so far), frequency (`penalty × count in the output`) and presence (`penalty` once if in
//! the output) subtracted. Greedy decoding takes the argmax of the processed logits.
//!
//! The state is the sequence so far, so a request continued on another worker (the generated
//! tokens sent as the tail of its prompt, `token_offset` = their count) penalizes exactly as it
//! would have where it started: [`Processors::new`] splits the prompt it is given the same way.

use std::collections::HashMap;

use crate::SamplingParams;

/// What one token has been so far.
#[derive(Clone, Copy, Debug, Default)]
struct Seen {
    in_prompt: bool,
    /// Times in the output.
    count: u32,
}

/// One sequence's logits processors and the history they read.
#[derive(Clone, Debug)]
pub struct Processors {
    repetition: f32,
    frequency: f32,
    presence: f32,
    bias: Vec<(u32, f32)>,
    /// Token sequences the output never completes.
    bad_words: Vec<Vec<u32>>,
    min_tokens: usize,
    /// Banned while fewer than `min_tokens` were generated.
    stop_ids: Vec<u32>,
    seen: HashMap<u32, Seen>,
    generated: usize,
    /// The output's last ids, as many as the longest bad word needs to be matched.
    tail: Vec<u32>,
    tail_len: usize,
}

impl Processors {
    /// The processors of `params` for a sequence whose prompt is `prompt`, its last
    /// `params.token_offset` ids being output generated earlier (elsewhere). `stop_ids` are the
    /// ids `min_tokens` holds back (the model's EOS and `stop_token_ids`); `bad_words` are the
    /// request's bad words as id sequences (see `ferry_tokenizer::Tokenizer::bad_word_ids`).
    /// None when the request asks for none of them.
    pub fn new(params: &SamplingParams, stop_ids: &[u32], bad_words: Vec<Vec<u32>>, prompt: &[u32]) -> Option<Processors> {
        if !params.processes_logits() {
            return None;
        }
        let offset = (params.token_offset as usize).min(prompt.len());
        let (asked, output) = prompt.split_at(prompt.len() - offset);
        let penalizes = params.repetition_penalty != 1.0;
        let mut seen: HashMap<u32, Seen> = HashMap::new();
        if penalizes {
            for &t in asked {
                seen.entry(t).or_default().in_prompt = true;
            }
        }
        let tail_len = bad_words.iter().map(|w| w.len().saturating_sub(1)).max().unwrap_or(0);
        let mut p = Processors {
            repetition: params.repetition_penalty,
            frequency: params.frequency_penalty,
            presence: params.presence_penalty,
            bias: params.logit_bias.clone(),
            bad_words,
            min_tokens: params.min_tokens,
            stop_ids: stop_ids.to_vec(),
            seen,
            generated: 0,
            tail: Vec::new(),
            tail_len,
        };
        for &t in output {
            p.record(t);
        }
        Some(p)
    }

    /// Takes a token into the output (sampled here, or the first token sampled on prefill).
    pub fn record(&mut self, token: u32) {
        self.generated += 1;
        self.seen.entry(token).or_default().count += 1;
        if self.tail_len > 0 {
            if self.tail.len() == self.tail_len {
                self.tail.remove(0);
            }
            self.tail.push(token);
        }
    }

    /// Tokens generated so far (the ones replayed from the prompt included).
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Processes `logits` in place for the next token. Ids beyond the vocabulary are skipped
    /// (workers refuse such ids in `logit_bias` before a request starts).
    pub fn apply(&self, logits: &mut [f32]) {
        let mut ban = |t: u32| {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        };
        for w in &self.bad_words {
            if let Some((&last, before)) = w.split_last()
                && self.tail.ends_with(before)
            {
                ban(last);
            }
        }
        if self.generated < self.min_tokens {
            self.stop_ids.iter().for_each(|&t| ban(t));
        }
        for &(t, b) in &self.bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        for (&t, s) in &self.seen {
            let Some(l) = logits.get_mut(t as usize) else { continue };
            if self.repetition != 1.0 && (s.in_prompt || s.count > 0) {
                *l = if *l > 0.0 { *l / self.repetition } else { *l * self.repetition };
            }
            if s.count > 0 {
                *l -= self.frequency * s.count as f32 + self.presence;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams::greedy(16)
    }

    #[test]
    fn none_without_a_processor() {
        assert!(Processors::new(&params(), &[0], Vec::new(), &[1, 2]).is_none());
        assert!(Processors::new(&SamplingParams { min_p: 0.5, ..params() }, &[0], Vec::new(), &[1]).is_none());
    }

    #[test]
    fn penalties_follow_the_rules_and_the_output_replayed_from_the_prompt() {
        // Prompt [1, 2], then output [2, 3, 3] replayed from the prompt (token_offset 3).
        let p = SamplingParams { repetition_penalty: 2.0, frequency_penalty: 0.5, presence_penalty: 0.25, token_offset: 3, ..params() };
        let procs = Processors::new(&p, &[], Vec::new(), &[1, 2, 2, 3, 3]).unwrap();
        assert_eq!(procs.generated(), 3);
        let mut l = vec![1.0f32, 4.0, -4.0, 6.0, 8.0];
        procs.apply(&mut l);
        // 0: untouched; 1: prompt only, halved; 2: prompt + once out: -4·2 - 0.5 - 0.25;
        // 3: twice out: 6/2 - 1.0 - 0.25; 4: untouched.
        assert_eq!(l, vec![1.0, 2.0, -8.75, 1.75, 8.0]);
    }

    #[test]
    fn min_tokens_bans_the_stop_ids_until_enough_were_generated() {
        let p = SamplingParams { min_tokens: 2, ..params() };
        let mut procs = Processors::new(&p, &[0, 3], Vec::new(), &[5]).unwrap();
        let mut l = vec![1.0f32; 4];
        procs.apply(&mut l);
        assert_eq!(l, vec![f32::NEG_INFINITY, 1.0, 1.0, f32::NEG_INFINITY]);
        procs.record(1);
        procs.record(2);
        let mut l = vec![1.0f32; 4];
        procs.apply(&mut l);
        assert_eq!(l, vec![1.0; 4]);
    }

    #[test]
    fn bias_and_bad_words() {
        let p = SamplingParams { logit_bias: vec![(1, 5.0), (99, 1.0)], bad_words: vec!["x".into()], ..params() };
        let mut procs = Processors::new(&p, &[], vec![vec![2], vec![3, 4, 1]], &[9]).unwrap();
        let mut l = vec![0.0f32; 5];
        procs.apply(&mut l);
        assert_eq!(l, vec![0.0, 5.0, f32::NEG_INFINITY, 0.0, 0.0]);
        procs.record(3);
        procs.record(4);
        let mut l = vec![0.0f32; 5];
        procs.apply(&mut l);
        // [3, 4] then 1 would complete the bad word: banned, its bias notwithstanding.
        assert_eq!(l, vec![0.0, f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0, 0.0]);
        procs.record(0);
        let mut l = vec![0.0f32; 5];
        procs.apply(&mut l);
        assert_eq!(l[1], 5.0);
    }
}
