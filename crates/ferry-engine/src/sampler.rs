//! Choosing the next token from logits: the request's logits processors first (penalties, bias,
//! `min_tokens`, bad words: [`ferry_core::processors`]), then greedy, or temperature with `min_p`,
//! top-k and top-p (nucleus, Holtzman et al. arXiv:1904.09751), in vLLM's order, over a seeded
//! generator, so a seed reproduces a sample.
//!
//! The random draw for completion token `i` is a function of the seed and `i` alone: SplitMix64's
//! state after `i` steps is `seed + i·γ`, so a sampler can start at any index
//! ([`SamplingParams::token_offset`]) and draw exactly what one started at 0 would draw there. A
//! request moved to another worker mid-stream (prompt + the tokens already sent, as the new
//! prompt, `token_offset` = their count) continues with the same sample. Greedy draws nothing.

use ferry_core::{Processors, SamplingError, SamplingParams};
use ferry_tokenizer::Tokenizer;

use crate::error::Result;

/// The logits processors of `params` for a sequence whose prompt is `prompt` (its last
/// `token_offset` ids generated earlier), on a model with `vocab` tokens whose EOS ids are
/// `eos`; None when the request asks for none. Its bad words are tokenized here; a `logit_bias`
/// id beyond the vocabulary is an error naming it.
pub fn processors_for(tokenizer: &Tokenizer, vocab: usize, eos: &[u32], params: &SamplingParams, prompt: &[u32]) -> Result<Option<Processors>> {
    if let Some(&(token, _)) = params.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
        return Err(SamplingError::LogitBiasToken { token, vocab }.into());
    }
    let bad_words = if params.bad_words.is_empty() { Vec::new() } else { tokenizer.bad_word_ids(&params.bad_words)? };
    Ok(Processors::new(params, &params.stop_ids(eos), bad_words, prompt))
}

/// SplitMix64's increment γ (the golden ratio in 64 bits).
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64 (Steele et al.): tiny, fast, and good enough to draw one uniform per token.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// The generator `index` steps after `seed` (without taking those steps).
    pub fn at(seed: u64, index: u64) -> Self {
        Rng(seed.wrapping_add(index.wrapping_mul(GAMMA)))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub struct Sampler {
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
    processors: Option<Processors>,
    rng: Rng,
}

/// Index of the largest logit (the first one on ties, as torch.argmax).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    /// A sampler whose first token is completion token `p.token_offset`.
    pub fn new(p: &SamplingParams) -> Self {
        let seed = p.seed.unwrap_or_else(|| {
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
            t ^ (std::process::id() as u64).rotate_left(32)
        });
        Self::with_rng(p, Rng::at(seed, u64::from(p.token_offset)))
    }

    fn with_rng(p: &SamplingParams, rng: Rng) -> Self {
        Self { temperature: p.temperature, top_k: p.top_k, top_p: p.top_p, min_p: p.min_p, processors: None, rng }
    }

    /// This sampler with the request's logits processors (built for its sequence so far).
    pub fn processing(self, processors: Option<Processors>) -> Self {
        Self { processors, ..self }
    }

    /// Whether [`Sampler::sample`] changes the logits it is given (processors; callers that
    /// need the model's own distribution, for logprobs, keep a copy first).
    pub fn alters_logits(&self) -> bool {
        self.processors.is_some()
    }

    /// Takes a token chosen elsewhere into the sequence (the first token, sampled by prefill):
    /// the penalties count it.
    pub fn record(&mut self, token: u32) {
        if let Some(p) = &mut self.processors {
            p.record(token);
        }
    }

    /// The generator's state (`seed + index·γ`, index = the next token's place in the
    /// completion), so another process can continue this sampler exactly (a prefill worker
    /// samples the first token, the decode worker the rest).
    pub fn rng_state(&self) -> u64 {
        self.rng.0
    }

    /// A sampler for `p` whose generator continues from `state` (see [`Sampler::rng_state`]).
    pub fn resume(p: &SamplingParams, state: u64) -> Self {
        Self::with_rng(p, Rng::new(state))
    }

    fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// The next token, taken into the sequence (the penalties count it). `logits` are processed
    /// in place when the request has processors. Every call moves to the next completion index,
    /// whether it draws (greedy does not) or not, so the draw for index `i` never depends on
    /// what came before it.
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        // This token's draw, and the generator moved on to the next index.
        let mut draw = self.rng.clone();
        self.rng.0 = self.rng.0.wrapping_add(GAMMA);
        if let Some(p) = &self.processors {
            p.apply(logits);
        }
        let token = if self.is_greedy() {
            argmax(logits)
        } else {
            let (idx, probs) = self.candidates(logits);
            let mass: f64 = probs.iter().sum();
            let mut u = draw.uniform() * mass;
            let mut pick = idx[idx.len() - 1];
            for (i, p) in probs.iter().enumerate() {
                if u < *p {
                    pick = idx[i];
                    break;
                }
                u -= p;
            }
            pick
        };
        self.record(token);
        token
    }

    /// The tokens a draw chooses among, most likely first, with their weights (probabilities
    /// over the tokens that survive `min_p` and top-k, the top-p cut then taken from them; the
    /// draw is proportional to the weights): temperature, then `min_p`, top-k and top-p, in
    /// vLLM's order, over logits already processed. Greedy: the argmax alone.
    pub fn candidates(&self, logits: &[f32]) -> (Vec<u32>, Vec<f64>) {
        if self.is_greedy() {
            return (vec![argmax(logits)], vec![1.0]);
        }
        let best = argmax(logits);
        let max = logits[best as usize];
        // Each token's log-probability relative to the most likely one's, after temperature.
        let scaled = |i: u32| f64::from((logits[i as usize] - max) / self.temperature);
        // min_p: p_i >= min_p · p_max, i.e. scaled(i) >= ln(min_p); the most likely token always
        // stays (even when every logit is -inf: a grammar and a ban together can leave none).
        let floor = if self.min_p > 0.0 { f64::from(self.min_p).ln() } else { f64::NEG_INFINITY };
        let mut idx: Vec<u32> = if self.min_p > 0.0 { (0..logits.len() as u32).filter(|&i| i == best || scaled(i) >= floor).collect() } else { (0..logits.len() as u32).collect() };
        // Top-k (cheap partial sort first), then sorted by logit, descending.
        let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]);
        let k = if self.top_k == 0 { idx.len() } else { self.top_k.min(idx.len()) };
        if k < idx.len() {
            idx.select_nth_unstable_by(k - 1, by_logit);
            idx.truncate(k);
        }
        idx.sort_by(by_logit);
        let mut probs: Vec<f64> = idx.iter().map(|&i| scaled(i).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        // Nucleus: the smallest prefix whose mass reaches top_p (always at least one token).
        if self.top_p < 1.0 {
            let mut cum = 0.0;
            if let Some(i) = probs.iter().position(|p| {
                cum += p;
                cum >= f64::from(self.top_p)
            }) {
                idx.truncate(i + 1);
                probs.truncate(i + 1);
            }
        }
        (idx, probs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, seed: Some(seed), ..SamplingParams::default() }
    }

    #[test]
    fn greedy_is_argmax_first_on_ties() {
        let mut s = Sampler::new(&params(0.0, 0, 1.0, 1));
        assert_eq!(s.sample(&mut [0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn seed_reproduces_and_top_k_restricts() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.7).sin()).collect();
        let draw = |seed| {
            let mut s = Sampler::new(&params(1.0, 5, 1.0, seed));
            (0..50).map(|_| s.sample(&mut logits.clone())).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        let mut top5: Vec<u32> = (0..100).collect();
        top5.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
        for t in draw(9) {
            assert!(top5[..5].contains(&t), "{t} outside top-5");
        }
    }

    #[test]
    fn resume_continues_the_same_draws() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.3).cos()).collect();
        let p = params(0.8, 0, 0.95, 11);
        let mut a = Sampler::new(&p);
        let first = a.sample(&mut logits.clone());
        let mut b = Sampler::resume(&p, a.rng_state());
        let rest_a: Vec<u32> = (0..20).map(|_| a.sample(&mut logits.clone())).collect();
        let rest_b: Vec<u32> = (0..20).map(|_| b.sample(&mut logits.clone())).collect();
        assert_eq!(rest_a, rest_b);
        let _ = first;
    }

    #[test]
    fn the_draw_for_a_token_depends_only_on_the_seed_and_its_index() {
        let logits: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 2.0).collect();
        let p = params(0.8, 0, 0.95, 1234);
        let mut from_start = Sampler::new(&p);
        let all: Vec<u32> = (0..40).map(|_| from_start.sample(&mut logits.clone())).collect();
        for k in [0u32, 1, 7, 39] {
            let mut at_k = Sampler::new(&SamplingParams { token_offset: k, ..p.clone() });
            let rest: Vec<u32> = (k..40).map(|_| at_k.sample(&mut logits.clone())).collect();
            assert_eq!(rest, all[k as usize..], "offset {k}");
        }
        // A sampler at offset k is the one started at 0 after k tokens, state for state.
        let mut a = Sampler::new(&p);
        for _ in 0..5 {
            a.sample(&mut logits.clone());
        }
        assert_eq!(a.rng_state(), Sampler::new(&SamplingParams { token_offset: 5, ..p.clone() }).rng_state());
        // Greedy advances the index too and never draws: the same ids at any offset.
        let g = params(0.0, 0, 1.0, 9);
        let mut s = Sampler::new(&SamplingParams { token_offset: 3, ..g });
        assert_eq!(s.sample(&mut logits.clone()), argmax(&logits));
        // One SplitMix64 step per sampled token, as before token_offset existed: the same
        // samples for the same seed.
        let mut s = Sampler::new(&p);
        for _ in 0..10 {
            s.sample(&mut logits.clone());
        }
        let mut rng = Rng::new(1234);
        (0..10).for_each(|_| {
            rng.next_u64();
        });
        assert_eq!(s.rng_state(), rng.0);
    }

    #[test]
    fn every_token_banned_still_gives_a_token_without_panicking() {
        let banned = vec![f32::NEG_INFINITY; 8];
        for (t, min_p, top_k, top_p) in [(0.0, 0.0, 0, 1.0), (0.8, 0.1, 0, 1.0), (0.8, 0.5, 3, 0.9), (1.0, 0.0, 0, 0.5)] {
            let mut s = Sampler::new(&SamplingParams { temperature: t, min_p, top_k, top_p, seed: Some(3), ..SamplingParams::default() });
            assert!(s.sample(&mut banned.clone()) < 8);
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // probabilities ~ [0.64, 0.24, 0.09, 0.03]: top_p 0.5 keeps only the first.
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let mut s = Sampler::new(&params(1.0, 0, 0.5, 3));
        assert!((0..200).all(|_| s.sample(&mut logits.clone()) == 0));
        // top_p 0.9 keeps three; the last never appears, the second does.
        let mut s = Sampler::new(&params(1.0, 0, 0.9, 3));
        let draws: Vec<u32> = (0..2000).map(|_| s.sample(&mut logits.clone())).collect();
        assert!(!draws.contains(&3));
        assert!(draws.contains(&1));
        // frequencies follow the renormalised probabilities
        let f0 = draws.iter().filter(|&&t| t == 0).count() as f64 / 2000.0;
        assert!((f0 - 0.665 / 0.9678).abs() < 0.05, "f0 = {f0}");
    }
}
