//! When a running choice is finished (`ferry_core::finish`): after each token it samples, and
//! at once when its first token already finishes it. A finished or failed choice leaves the
//! batch with its sequence, whose blocks its handle gives back.

use super::admission::DecodeEvent;
use super::speculate::SeqSpec;
use crate::error::WorkerError;
use crate::load::Reservation;
use crate::pick::Picker;
use ferry_core::finish::{After, Bounds};
use ferry_core::TokenLogprob;
use ferry_engine::{FinishReason, Sequence};
use std::sync::Arc;
use tokio::sync::mpsc;

/// One choice of a request in the running batch.
pub(super) struct Running {
    pub request_id: String,
    /// Which of the request's choices this sequence is (`SamplingParams::n`).
    pub choice: u32,
    pub seq: Sequence,
    pub picker: Picker,
    pub stop_ids: Vec<u32>,
    pub count: usize,
    pub last: u32,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    /// Alternatives per token when logprobs are asked for.
    pub logprobs: Option<u32>,
    pub events: mpsc::UnboundedSender<DecodeEvent>,
    /// The request's KV reservation, shared by its choices: released with the last.
    pub _reservation: Arc<Reservation>,
    /// Its speculation state (None with speculation off).
    pub spec: Option<SeqSpec>,
}

/// Account for a newly sampled token (`lp`: its logprob, when asked for); Some(reason) when the
/// sequence is finished.
pub(super) fn advance(r: &mut Running, tok: u32, lp: Option<TokenLogprob>, ctx: usize) -> Option<FinishReason> {
    let bounds = Bounds { stop_ids: &r.stop_ids, max_tokens: r.max_tokens, prompt_tokens: r.prompt_tokens, context: ctx };
    if let Some(f) = bounds.stops(tok) {
        return Some(f);
    }
    r.count += 1;
    r.last = tok;
    let _ = r.events.send(DecodeEvent::Token { choice: r.choice, token: tok, logprob: lp });
    bounds.after(After { token: tok, count: r.count, grammar_done: r.picker.finished(), stop_string: false })
}

/// Whether a choice whose first token is `first` is finished by it (`count`: its completion
/// tokens so far, 0 for a stop token and 1 otherwise).
pub(super) fn finished_by_first(bounds: &Bounds, first: u32, is_stop: bool, count: usize, picker: &Picker) -> Option<FinishReason> {
    match is_stop {
        true => Some(FinishReason::StopToken(first)),
        false => bounds.after(After { token: first, count, grammar_done: picker.finished(), stop_string: false }),
    }
}

/// A choice leaves the batch: its last event (finished, or failed), and its sequence's blocks go
/// back as `r` drops.
pub(super) fn leave(r: Running, end: Result<FinishReason, WorkerError>) {
    let _ = r.events.send(match end {
        Ok(reason) => {
            let spec = r.spec.as_ref().map_or((0, 0), |s| (s.proposed as u32, s.accepted as u32));
            DecodeEvent::Finished { choice: r.choice, reason, completion_tokens: r.count as u32, spec }
        }
        Err(e) => DecodeEvent::Failed(e),
    });
}
