//! Log-probabilities of tokens under the model: what the OpenAI API returns as `logprobs`
//! (generated tokens, with the most likely alternatives) and what `echo` returns for the prompt.
//!
//! The distribution is the model's own: the log-softmax of the raw logits, before temperature,
//! top-k and top-p shape the sampler's distribution (vLLM's default, `logprobs_mode =
//! raw_logprobs`). A sampled token outside the top-k/top-p cut still has its model logprob, and a
//! greedy token is always the top-1 alternative. Sums are taken in f64 after subtracting the
//! largest logit, so nothing overflows and the result is exact to f32 rounding.

/// The most alternatives one token may ask for (vLLM's cap; OpenAI's chat API allows 20 too).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// One token's log-probability, and the `top` most likely tokens at its position (most likely
/// first, ties broken by the lower id), each with its log-probability.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// `log Σ exp(logits)`, stably: the largest logit is taken out before the sum (in f64).
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        // Empty, all -inf, or +inf present: nothing sensible to subtract.
        return max as f64;
    }
    let m = max as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - m).exp()).sum();
    m + sum.ln()
}

/// The `n` largest logits' ids, largest first; ties go to the lower id (as `torch.topk` on CPU
/// and vLLM order them in practice, and deterministically here). O(vocab · n) for small n.
pub fn top_ids(logits: &[f32], n: usize) -> Vec<u32> {
    let n = n.min(logits.len());
    let mut top: Vec<u32> = Vec::with_capacity(n + 1);
    if n == 0 {
        return top;
    }
    // `a` ranks before `b`: larger logit, then lower id. NaN ranks last.
    let before = |a: u32, b: u32| {
        let (x, y) = (logits[a as usize], logits[b as usize]);
        match (x.is_nan(), y.is_nan()) {
            (false, true) => true,
            (true, _) => false,
            _ => x > y || (x == y && a < b),
        }
    };
    for id in 0..logits.len() as u32 {
        if top.len() == n && !before(id, top[n - 1]) {
            continue;
        }
        let at = top.iter().position(|&t| before(id, t)).unwrap_or(top.len());
        top.insert(at, id);
        top.truncate(n);
    }
    top
}

/// `token`'s log-probability under `logits` (one position's row, the whole vocabulary), with the
/// `top_n` most likely alternatives. A `token` outside the row gets `-inf`.
pub fn token_logprob(logits: &[f32], token: u32, top_n: usize) -> TokenLogprob {
    let lse = log_sum_exp(logits);
    let lp = |id: u32| logits.get(id as usize).map_or(f32::NEG_INFINITY, |&x| (x as f64 - lse) as f32);
    TokenLogprob { token, logprob: lp(token), top: top_ids(logits, top_n).into_iter().map(|id| (id, lp(id))).collect() }
}

/// Prompt log-probabilities from the logits of a run of positions: `rows` is `[k, vocab]`
/// (row `i` the logits after `next[i]`'s predecessor), `next[i]` the token that actually came
/// next. Rows beyond `next` are ignored (the last prompt position predicts the first generated
/// token, not a prompt token).
pub fn prompt_logprobs(rows: &[f32], vocab: usize, next: &[u32], top_n: usize) -> Vec<TokenLogprob> {
    if vocab == 0 {
        return Vec::new();
    }
    rows.chunks_exact(vocab).zip(next).map(|(row, &t)| token_logprob(row, t, top_n)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The textbook definition in f64, for comparison.
    fn reference(logits: &[f32]) -> Vec<f64> {
        let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
        logits.iter().map(|&x| x as f64 - z.ln()).collect()
    }

    #[test]
    fn matches_the_definition_and_probabilities_sum_to_one() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let want = reference(&logits);
        for t in [0u32, 7, 49] {
            let got = token_logprob(&logits, t, 0);
            assert!((got.logprob as f64 - want[t as usize]).abs() < 1e-6, "{t}: {} vs {}", got.logprob, want[t as usize]);
            assert!(got.top.is_empty());
        }
        let total: f64 = (0..50).map(|t| (token_logprob(&logits, t, 0).logprob as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5, "{total}");
    }

    #[test]
    fn large_logits_do_not_overflow() {
        // exp(1000) overflows f64; the max-subtracted sum does not.
        let logits = [1000.0f32, 999.0, 0.0, -1000.0];
        let got = token_logprob(&logits, 1, 2);
        let want = -1.0 - (1.0 + (-1.0f64).exp()).ln();
        assert!((got.logprob as f64 - want).abs() < 1e-6, "{got:?}");
        assert_eq!(got.top.iter().map(|t| t.0).collect::<Vec<_>>(), [0, 1]);
        assert!(got.top[0].1 > got.top[1].1);
        // A lone finite logit is certain.
        assert_eq!(token_logprob(&[f32::NEG_INFINITY, 5.0], 1, 1).logprob, 0.0);
    }

    #[test]
    fn top_n_is_sorted_and_ties_go_to_the_lower_id() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, f32::NAN, 2.0, -1.0];
        assert_eq!(top_ids(&logits, 5), [1, 3, 2, 5, 0]);
        assert_eq!(top_ids(&logits, 1), [1]);
        assert_eq!(top_ids(&logits, 0), Vec::<u32>::new());
        assert_eq!(top_ids(&logits, 100).len(), 7, "at most the vocabulary, NaN last");
        assert_eq!(*top_ids(&logits, 100).last().unwrap(), 4);
        // The chosen token need not be among the top ones; its logprob is still given.
        let lp = token_logprob(&logits[..4], 0, 2);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3]);
        assert!(lp.logprob < lp.top[1].1);
        // Out of range: -inf, not a panic.
        assert_eq!(token_logprob(&logits, 99, 0).logprob, f32::NEG_INFINITY);
    }

    #[test]
    fn greedy_token_is_top_one() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1009) as f32 * 0.01).collect();
        let best = (0..1000u32).max_by(|&a, &b| logits[a as usize].total_cmp(&logits[b as usize]).then(b.cmp(&a))).unwrap();
        let lp = token_logprob(&logits, best, 20);
        assert_eq!(lp.top.len(), 20);
        assert_eq!(lp.top[0], (best, lp.logprob));
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }

    #[test]
    fn prompt_rows_pair_with_the_next_tokens() {
        let vocab = 4;
        let rows = [0.0f32, 1.0, 2.0, 3.0, 3.0, 2.0, 1.0, 0.0, 9.0, 9.0, 9.0, 9.0];
        let got = prompt_logprobs(&rows, vocab, &[3, 0], 1);
        assert_eq!(got.len(), 2, "the third row predicts a generated token: ignored");
        assert_eq!((got[0].token, got[0].top[0].0), (3, 3));
        assert_eq!((got[1].token, got[1].top[0].0), (0, 0));
        assert!((got[0].logprob - got[1].logprob).abs() < 1e-7);
        assert!(prompt_logprobs(&rows, 0, &[1], 1).is_empty());
    }
}
