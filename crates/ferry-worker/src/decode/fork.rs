//! A request whose first tokens are known joins the running batch, one sequence per choice that
//! its first token does not already finish (`SamplingParams::n`): the first such choice runs on
//! the request's sequence, each other on a fork of it (sharing the prompt's full blocks, with its
//! own copy of the last partial one; `Engine::fork`).

use super::admission::DecodeEvent;
use super::finish::{finished_by_first, Running};
use super::speculate::Speculator;
use crate::error::WorkerError;
use crate::load::Reservation;
use crate::pick::Picker;
use ferry_core::finish::Bounds;
use ferry_core::SamplingParams;
use ferry_engine::{Engine, Sequence};
use std::sync::Arc;
use tokio::sync::mpsc;

/// One choice's first token and chooser, as a request joins the running batch.
pub(super) struct Start {
    pub token: u32,
    pub is_stop: bool,
    pub picker: Picker,
}

/// A request joining the running batch on `seq`.
pub(super) struct Joining<'a> {
    pub request_id: &'a str,
    pub seq: Sequence,
    pub choices: Vec<Start>,
    pub params: &'a SamplingParams,
    pub prompt_tokens: usize,
    pub events: mpsc::UnboundedSender<DecodeEvent>,
    pub reservation: Reservation,
    /// The prompt's ids, as far as this worker knows them (for speculation's proposers).
    pub context: &'a [u32],
}

/// The request's running choices (none when every choice finished on its first token, or a
/// fork failed: the request has its events already). Sequences no choice needs drop here,
/// which frees their blocks.
pub(super) fn join(engine: &mut Engine, speculator: &mut Speculator, j: Joining) -> Vec<Running> {
    let Joining { request_id, seq, choices, params, prompt_tokens, events, reservation, context: prompt } = j;
    let stop_ids = engine.stop_ids(params);
    let reservation = Arc::new(reservation);
    let context = engine.config().max_position;
    let mut seq = Some(seq);
    let mut joined: Vec<Running> = Vec::new();
    let mut ended = Vec::new();
    for (i, Start { token: first, is_stop, picker }) in choices.into_iter().enumerate() {
        let choice = i as u32;
        let count = usize::from(!is_stop);
        let bounds = Bounds { stop_ids: &stop_ids, max_tokens: params.max_tokens, prompt_tokens, context };
        if let Some(reason) = finished_by_first(&bounds, first, is_stop, count, &picker) {
            ended.push(DecodeEvent::Finished { choice, reason, completion_tokens: count as u32, spec: (0, 0) });
            continue;
        }
        // The first continuing choice takes `seq`; every other a fork of the prompt's KV.
        let own = match joined.first() {
            None => seq.take().ok_or(None),
            Some(lead) => engine.fork(lead.seq.id()).map(|id| engine.own(id)).map_err(Some),
        };
        let own = match own {
            Ok(s) => s,
            Err(e) => {
                let what = format!("forking the prompt's KV for choice {choice}: {}", e.map_or_else(|| "no sequence".to_string(), |e| e.to_string()));
                // `joined` and `seq` drop with this return: their blocks go back.
                let _ = events.send(DecodeEvent::Failed(WorkerError::SequenceFailed { request_id: request_id.to_string(), what }));
                return Vec::new();
            }
        };
        joined.push(Running {
            request_id: request_id.to_string(),
            choice,
            seq: own,
            picker,
            stop_ids: stop_ids.clone(),
            count,
            last: first,
            prompt_tokens,
            max_tokens: params.max_tokens,
            logprobs: params.logprobs,
            events: events.clone(),
            _reservation: reservation.clone(),
            spec: speculator.start(&[prompt, std::slice::from_ref(&first)].concat()),
        });
    }
    // `seq`, when no choice took it, drops here.
    drop(seq);
    for e in ended {
        let _ = events.send(e);
    }
    if !joined.is_empty() {
        tracing::debug!(request_id, choices = joined.len(), "joined the running batch");
    }
    joined
}
