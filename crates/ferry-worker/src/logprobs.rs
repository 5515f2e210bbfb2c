//! Log-probabilities on the workers (the math is [`ferry_core::logprobs`]): which logits a
//! prompt chunk needs, and what its rows give. Shared by the prefill worker and the decode engine thread's
//! own prefills (colocated and local), so the three paths compute prompt logprobs one way.
//!
//! A prompt whose logprobs are asked for (`SamplingParams::prompt_logprobs`) is computed whole
//! (no cached prefix: the callers start it on an empty sequence) with the logits of every
//! position, in chunks of at most [`PROMPT_LOGPROBS_CHUNK`] tokens so the rows stay small. Row
//! `i` of a chunk starting at `s` predicts prompt token `s + i + 1`; the last prompt position's
//! row predicts the first generated token and is the one sampled from.

use ferry_core::logprobs::{prompt_logprobs, token_logprob};
use ferry_core::{SamplingParams, TokenLogprob};
use ferry_engine::Logits;
use std::ops::Range;

/// Most prompt tokens per step for a prompt whose logprobs are asked for: each position's row of
/// logits comes back (256 rows of SmolLM2's 49152-token vocabulary are 50 MB of f32).
pub const PROMPT_LOGPROBS_CHUNK: usize = 256;

/// Most tokens of `params`'s prompt one step may carry.
pub fn chunk_cap(params: &SamplingParams) -> usize {
    match params.prompt_logprobs {
        Some(_) => PROMPT_LOGPROBS_CHUNK,
        None => usize::MAX,
    }
}

/// The logits the chunk `range` of a `len`-token prompt needs: every row when the prompt's
/// logprobs are asked for, else the last row when the chunk ends the prompt, else none.
pub fn chunk_logits(params: &SamplingParams, range: &Range<usize>, len: usize) -> Logits {
    match (params.prompt_logprobs, range.end == len) {
        (Some(_), _) => Logits::All,
        (None, true) => Logits::Last,
        (None, false) => Logits::None,
    }
}

/// What a computed chunk's `logits` (as [`chunk_logits`] asked) give: the prompt logprobs of its
/// rows are appended to `acc`, and the last prompt position's row is returned when the chunk
/// ends the prompt (empty otherwise).
pub fn take_chunk(params: &SamplingParams, prompt: &[u32], range: Range<usize>, logits: Vec<f32>, acc: &mut Vec<TokenLogprob>) -> Vec<f32> {
    let ends = range.end == prompt.len();
    let Some(top) = params.prompt_logprobs else {
        return if ends { logits } else { Vec::new() };
    };
    let rows = range.len();
    if rows == 0 || logits.len() % rows != 0 {
        return Vec::new();
    }
    let vocab = logits.len() / rows;
    // Row i predicts prompt[range.start + i + 1], while there is one.
    let next = &prompt[(range.start + 1).min(prompt.len())..(range.end + 1).min(prompt.len())];
    acc.extend(prompt_logprobs(&logits, vocab, next, top as usize));
    match ends {
        true => logits[(rows - 1) * vocab..].to_vec(),
        false => Vec::new(),
    }
}

/// The sampled `token`'s logprob under `logits`, when `params` asks for logprobs.
pub fn of_token(params: &SamplingParams, logits: &[f32], token: u32) -> Option<TokenLogprob> {
    params.logprobs.map(|n| token_logprob(logits, token, n as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_give_every_prompt_position_once() {
        let vocab = 3;
        let prompt = [2u32, 0, 1, 2, 1];
        // Position p's row favours token (p + 1) % 3.
        let row = |p: usize| -> Vec<f32> { (0..vocab).map(|t| if t == (p + 1) % vocab { 2.0 } else { 0.0 }).collect() };
        let p = SamplingParams { prompt_logprobs: Some(1), ..Default::default() };
        let mut acc = Vec::new();
        let mut last = Vec::new();
        for r in [0..2, 2..4, 4..5] {
            assert_eq!(chunk_logits(&p, &r, prompt.len()), Logits::All);
            let logits: Vec<f32> = r.clone().flat_map(row).collect();
            last = take_chunk(&p, &prompt, r, logits, &mut acc);
        }
        assert_eq!(last, row(4), "the last position's row is sampled from");
        assert_eq!(acc.iter().map(|l| l.token).collect::<Vec<_>>(), prompt[1..], "one entry per prompt token after the first");
        assert_eq!(acc.iter().map(|l| l.top[0].0).collect::<Vec<u32>>(), [1, 2, 0, 1]);
        // Without prompt logprobs only the last chunk's single row comes back.
        let p = SamplingParams::default();
        assert_eq!(chunk_logits(&p, &(0..2), 5), Logits::None);
        assert_eq!(chunk_logits(&p, &(2..5), 5), Logits::Last);
        assert_eq!(take_chunk(&p, &prompt, 2..5, row(4), &mut acc), row(4));
        assert_eq!(chunk_cap(&p), usize::MAX);
        assert!(of_token(&p, &row(0), 1).is_none());
        let p = SamplingParams { logprobs: Some(2), ..Default::default() };
        assert_eq!(of_token(&p, &row(0), 1).map(|l| l.top.len()), Some(2));
    }
}
