//! What the prefill engine thread sends to a request's transfer task ([`Outbound`]).

use crate::error::WorkerError;
use crate::kv::chunks::{chunk_ranges, MAX_CHUNK_BYTES};
use bytes::Bytes;
use std::time::{Duration, Instant};

/// What the prefill engine thread sends to a request's transfer task.
pub enum Outbound {
    /// One layer's K and V for the whole prompt, at `offset` in the payload body, with the
    /// CRC-32 of each of its [`MAX_CHUNK_BYTES`] chunks (see [`Outbound::layer`]).
    Layer { offset: u64, data: Bytes, crcs: Vec<u32> },
    /// One layer's K and V at `offset`, in the engine's own memory (device memory on a GPU):
    /// a pipe sends it from there; a host transport copies it out first.
    Buffer { offset: u64, buf: ferry_engine::KvBuffer },
    /// The prompt is done: the first token, and the lease that keeps its KV until acknowledged.
    End {
        first_token: u32,
        first_is_stop: bool,
        /// Asked for with `SamplingParams::logprobs`; for the router, not the decode worker.
        first_logprob: Option<ferry_core::TokenLogprob>,
        /// Asked for with `SamplingParams::prompt_logprobs` (the prompt's tokens from the second).
        prompt_logprobs: Vec<ferry_core::TokenLogprob>,
        sampler_state: u64,
        /// With `SamplingParams::n` > 1: choices 1 to n - 1's first tokens (the fields above
        /// are choice 0's); they travel with the KV's end to the decode worker.
        more_choices: Vec<FirstChoice>,
        queued: Duration,
        computed: Duration,
        computed_at: Instant,
        lease: Box<dyn Send + Sync>,
    },
    Failed(WorkerError),
}

impl Outbound {
    /// A layer message, checksummed here: on the prefill side this runs on the engine thread as
    /// each layer is exported (a fraction of a percent of the layer's compute), so the transfer
    /// task only writes.
    pub fn layer(offset: u64, data: Bytes) -> Self {
        let crcs = chunk_ranges(data.len(), MAX_CHUNK_BYTES).map(|r| crc32fast::hash(&data[r])).collect();
        Outbound::Layer { offset, data, crcs }
    }
}

/// One more choice's first token (`SamplingParams::n` > 1), as the engine thread sampled it.
#[derive(Clone, Debug, PartialEq)]
pub struct FirstChoice {
    pub token: u32,
    pub is_stop: bool,
    /// The choice's sampler state after the token, so the decode worker continues it.
    pub sampler_state: u64,
    pub logprob: Option<ferry_core::TokenLogprob>,
}

impl FirstChoice {
    /// As it travels, in the KV's end and prefill's answer.
    pub fn to_wire(&self) -> ferry_proto::v1::FirstToken {
        ferry_proto::v1::FirstToken { token: self.token, is_stop: self.is_stop, sampler_state: self.sampler_state, logprob: self.logprob.as_ref().map(ferry_proto::logprob_to_wire) }
    }
}
