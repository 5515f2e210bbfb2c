//! Moving one request's KV from a prefill worker to a decode worker.
//!
//! The prefill engine thread exports each layer as soon as the forward pass has computed it
//! (DistServe arXiv:2401.09670 §4 and Splitwise arXiv:2311.18677 §4.3 overlap the transfer with
//! prefill the same way) and hands it to a transfer task as an [`Outbound`] message. The task
//! cuts it into checksummed chunks and sends them over a [`transport::KvTransport`]; the decode
//! side's [`receiver::KvReceiver`] validates and assembles them into one payload
//! (`ferry_core::KvPayloadHeader` + body), whatever transport carried them: every transport is a
//! thin driver ([`drive`]) of one pure state machine ([`inbound`]), and TCP and the NCCL pipe
//! share one frame format ([`frame`]).
//!
//! A prefill worker with device pipes (NCCL) exports each layer as a [`ferry_engine::KvBuffer`]
//! instead ([`Outbound::Buffer`]): on a GPU the layer stays in the gather buffer on the device,
//! and the pipe sends it device to device into a payload body the decode worker allocated on its
//! own device, which its engine then scatters from. A host transport (the fallback) copies the
//! buffer out and sends it like any other layer.

pub mod assembler;
mod drive;
pub mod frame;
#[cfg(any(test, feature = "testing"))]
mod in_process;
pub mod inbound;
pub mod pipe;
pub mod receiver;
pub mod transport;

use crate::WorkerError;
use bytes::Bytes;
use std::ops::Range;
use std::time::{Duration, Instant};

/// Largest data chunk: well under gRPC's message limit, large enough to amortise per-chunk costs.
pub const MAX_CHUNK_BYTES: usize = 1 << 20;

/// How long one step of a transfer may make no progress before the transfer is failed: a chunk
/// the peer does not take, the next chunk that does not arrive, an acknowledgement that does not
/// come. A frozen peer (stopped, swapping, its network gone without a reset) holds an open
/// connection forever; this bounds what the transfer holds meanwhile (the prefill lease, the
/// decode side's payload buffer).
pub const DEFAULT_STALL: Duration = Duration::from_secs(30);

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
        more_choices: Vec<ferry_proto::v1::FirstToken>,
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

/// Byte ranges of at most `max` covering `0..len`.
pub fn chunk_ranges(len: usize, max: usize) -> impl Iterator<Item = Range<usize>> {
    let max = max.max(1);
    (0..len.div_ceil(max)).map(move |i| i * max..((i + 1) * max).min(len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_exactly() {
        let cases = [(0, 4, vec![]), (3, 4, vec![0..3]), (8, 4, vec![0..4, 4..8]), (9, 4, vec![0..4, 4..8, 8..9])];
        for (len, max, want) in cases {
            assert_eq!(chunk_ranges(len, max).collect::<Vec<_>>(), want, "len {len} max {max}");
        }
    }
}
