//! What the decode engine thread takes ([`Admission`], from a [`Source`]) and what it answers
//! ([`DecodeEvent`]): Ferry's own types only. The gRPC service converts the wire's at its edge
//! ([`super::service`]).

use crate::error::WorkerError;
use crate::role::Role;
use crate::load::Reservation;
use crate::pick::Rules;
use ferry_core::{SamplingParams, TokenLogprob};
use ferry_engine::{FinishReason, Sequence};
use std::sync::mpsc as std_mpsc;
use tokio::sync::{mpsc, oneshot};

pub enum DecodeEvent {
    /// A generated token of choice `choice` (0 unless `SamplingParams::n` > 1), with its logprob
    /// when asked for (`SamplingParams::logprobs`).
    Token { choice: u32, token: u32, logprob: Option<TokenLogprob> },
    /// The prompt's logprobs (`SamplingParams::prompt_logprobs`), before the first token, when
    /// this worker computed the prompt.
    PromptLogprobs(Vec<TokenLogprob>),
    /// Choice `choice` ended; the request ends with its last choice.
    /// `spec`: tokens proposed for the choice and verified, and those accepted.
    Finished { choice: u32, reason: FinishReason, completion_tokens: u32, spec: (u32, u32) },
    /// The request ended with this error (its sequence is freed).
    Failed(WorkerError),
}

/// One choice's first token, sampled on the prefill worker, as it came with the KV's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FirstToken {
    pub token: u32,
    /// The token is a stop token: the choice is finished.
    pub is_stop: bool,
    /// The choice's sampler state after it, to continue sampling here.
    pub sampler_state: u64,
}

/// Where an admitted sequence's KV comes from.
pub enum Source {
    /// Shipped by a prefill worker: import it; `imported` gets the outcome and the buffer back.
    /// `device`: the body, when it arrived device to device (`payload` is then the header alone).
    /// `firsts`: each choice's first token (choice 0 first). `onto`: the sequence that holds the
    /// prompt's cached prefix, which the payload (a span from its end) extends; `tokens`: the
    /// payload's token ids, so its full blocks are cached here; `context`: the whole prompt's
    /// ids when the router sent them (empty otherwise), for speculation's proposers.
    Kv {
        payload: Vec<u8>,
        device: Option<ferry_engine::KvBuffer>,
        firsts: Vec<FirstToken>,
        onto: Option<HeldPrefix>,
        tokens: Option<Vec<u32>>,
        context: Vec<u32>,
        imported: oneshot::Sender<(Result<(), WorkerError>, Vec<u8>)>,
    },
    /// Compute the prompt here (colocated; or a decode worker's short suffix after a cached
    /// prefix), starting on the prefix `held` holds when there is one.
    Prompt { prompt: Vec<u32>, held: Option<HeldPrefix> },
}

/// What the engine thread is asked.
pub(super) enum Cmd {
    Admit(Admission),
    /// Start a sequence on the longest cached prefix of `tokens` (at most `max` tokens).
    Attach { tokens: Vec<u32>, salt: Vec<u8>, max: usize, reply: oneshot::Sender<(Sequence, usize)> },
    /// Free a held prefix now (so the load the engine thread publishes counts its blocks free).
    Release(Sequence),
}

/// A sequence started on a cached prefix, not yet running: its blocks are held (they cannot be
/// evicted) until it runs, and freed if it is dropped first (the request failed or went away).
pub struct HeldPrefix {
    seq: Option<Sequence>,
    /// Leading prompt tokens it holds (whole blocks; 0 when nothing was cached).
    pub cached: usize,
    tx: std_mpsc::Sender<Cmd>,
}

impl HeldPrefix {
    pub(super) fn new(seq: Sequence, cached: usize, tx: std_mpsc::Sender<Cmd>) -> Self {
        HeldPrefix { seq: Some(seq), cached, tx }
    }

    pub(super) fn take(mut self) -> Option<Sequence> {
        self.seq.take()
    }
}

impl Drop for HeldPrefix {
    fn drop(&mut self) {
        // Told to the engine thread, which wakes to free it; if the thread is gone, the handle
        // drops here and its engine went with the thread.
        if let Some(seq) = self.seq.take() {
            let _ = self.tx.send(Cmd::Release(seq));
        }
    }
}

/// A request handed to the engine thread.
pub struct Admission {
    pub request_id: String,
    pub source: Source,
    pub params: SamplingParams,
    pub prompt_tokens: usize,
    pub events: mpsc::UnboundedSender<DecodeEvent>,
    pub reservation: Reservation,
    /// The structured-output matcher, over the completion so far (not yet the first token).
    pub rules: Rules,
}

/// How a worker schedules its steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scheduling {
    /// Takes prompts (a colocated worker).
    pub accept_prompts: bool,
    /// Chunked prefill with this token budget per step; None: prefill first, whole prompts.
    pub chunk_tokens: Option<usize>,
    /// Speculative decoding ([`super::speculate`]).
    pub spec: super::speculate::SpecConfig,
}

impl Scheduling {
    /// The role a worker scheduling so plays: colocated when it takes prompts, else decode.
    pub fn role(self) -> Role {
        if self.accept_prompts { Role::Colocated } else { Role::Decode }
    }
}
